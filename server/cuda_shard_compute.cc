#include "server/cuda_shard_compute.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/kernels.h"

namespace flatshard::server::internal {
namespace {

namespace kc = kernels::cuda;


class CudaShardCompute final : public ShardCompute {
 public:
  CudaShardCompute(int device, cudaStream_t stream, kc::DeviceMemory scalar, kc::PinnedMemory host_scalar)
      : device_(device), stream_(stream), scalar_(std::move(scalar)), host_scalar_(std::move(host_scalar)) {}
  ~CudaShardCompute() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  MemoryTier tier() const override { return MemoryTier::kDevice; }

  absl::StatusOr<ShardBuffer> AllocateShard(size_t bytes, absl::string_view what) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    FLATSHARD_ASSIGN_OR_RETURN(kc::DeviceMemory memory, kc::DeviceMemory::Allocate(bytes, what));
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(memory.data(), 0, bytes, stream_));
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return ShardBuffer(memory.release(), bytes, &kc::DeviceMemory::Free);
  }
  absl::StatusOr<ShardBuffer> AllocateStaging(size_t bytes, absl::string_view what) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return AllocatePinned(bytes, what);
  }

  absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                    int64_t numel) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return kc::Cast(src_dtype, src, dst_dtype, dst, numel, stream_);
  }
  absl::Status Reduce(absl::Span<const kernels::Contribution> contributions, float* dst,
                      int64_t numel, float alpha) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return kc::Reduce(contributions, dst, numel, alpha, stream_);
  }
  absl::Status Scale(float* x, int64_t numel, float alpha) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return kc::Scale(x, numel, alpha, stream_);
  }
  absl::Status SgdStep(const kernels::SgdHyperparams& hp, bool first_step, float* param,
                       const float* grad, float* momentum_buffer, int64_t numel) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return kc::SgdStep(hp, first_step, param, grad, momentum_buffer, numel, stream_);
  }
  absl::Status AdamStep(const kernels::AdamHyperparams& hp, int64_t step, float* param,
                        const float* grad, float* exp_avg, float* exp_avg_sq,
                        float* max_exp_avg_sq, int64_t numel) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return kc::AdamStep(hp, step, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, numel, stream_);
  }

  absl::StatusOr<double> NormPartial(const float* x, int64_t numel, double norm_type) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const bool inf = std::isinf(norm_type);
    if (inf) {
      FLATSHARD_RETURN_IF_ERROR(kc::MaxAbs(x, numel, scalar_.as<float>(), stream_));
    } else {
      FLATSHARD_RETURN_IF_ERROR(kc::SquaredNorm(x, numel, scalar_.as<double>(), stream_));
    }
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_scalar_.data(), scalar_.data(),
                                                   sizeof(double), cudaMemcpyDeviceToHost, stream_));
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return inf ? static_cast<double>(*host_scalar_.as<float>()) : *host_scalar_.as<double>();
  }

  absl::Status CopyToHost(const float* shard, float* host, int64_t numel) override {
    FLATSHARD_RETURN_IF_ERROR(CopyBytes(host, shard, numel * sizeof(float)));
    return Synchronize();
  }
  absl::Status CopyFromHost(const float* host, float* shard, int64_t numel) override {
    FLATSHARD_RETURN_IF_ERROR(CopyBytes(shard, host, numel * sizeof(float)));
    return Synchronize();
  }
  absl::Status Zero(float* shard, int64_t numel) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(shard, 0, numel * sizeof(float), stream_));
    return absl::OkStatus();
  }
  absl::Status CopyBytes(void* dst, const void* src, size_t bytes) override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    FLATSHARD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  const int device_;
  const cudaStream_t stream_;
  kc::DeviceMemory scalar_;      // a norm's result on the device
  kc::PinnedMemory host_scalar_;  // ... and on the host
};

}  // namespace

absl::Status CheckCudaDevice() {
  FLATSHARD_ASSIGN_OR_RETURN(int count, kc::DeviceCount());
  if (count == 0) {
    return absl::FailedPreconditionError(
        "this machine has no CUDA device (or no driver); use --memory=host");
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardBuffer> AllocatePinnedUnwritten(size_t bytes, absl::string_view what) {
  FLATSHARD_ASSIGN_OR_RETURN(kc::PinnedMemory memory, kc::PinnedMemory::Allocate(bytes, what));
  return ShardBuffer(memory.release(), bytes, &kc::PinnedMemory::Free);
}

absl::StatusOr<ShardBuffer> AllocatePinned(size_t bytes, absl::string_view what) {
  FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer buffer, AllocatePinnedUnwritten(bytes, what));
  if (bytes > 0) std::memset(buffer.data(), 0, bytes);
  return buffer;
}

absl::StatusOr<std::unique_ptr<ShardCompute>> MakeCudaShardCompute() {
  FLATSHARD_RETURN_IF_ERROR(CheckCudaDevice());
  int device = 0;
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  FLATSHARD_ASSIGN_OR_RETURN(kc::DeviceMemory scalar, kc::DeviceMemory::Allocate(sizeof(double), "norm result"));
  FLATSHARD_ASSIGN_OR_RETURN(kc::PinnedMemory host_scalar,
                             kc::PinnedMemory::Allocate(sizeof(double), "norm result"));
  cudaStream_t stream = nullptr;
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::make_unique<CudaShardCompute>(device, stream, std::move(scalar), std::move(host_scalar));
}

}  // namespace flatshard::server::internal
