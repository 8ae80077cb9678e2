// The host and pinned tiers (CPU kernels) and the tier factory.
#include "server/shard_compute.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/huge_pages.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"
#if FLATSHARD_HAVE_CUDA
#include "server/cuda_shard_compute.h"
#endif

namespace flatshard::server {
namespace {

void FreeHost(void* data) { std::free(data); }

// Zeroed heap memory (the host tier's shards).
absl::StatusOr<ShardBuffer> AllocateHost(size_t bytes, absl::string_view what) {
  FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer buffer, AllocateHostUnwritten(bytes, what));
  if (bytes > 0) std::memset(buffer.data(), 0, bytes);
  return buffer;
}

// Host memory, plain or pinned, and the CPU kernels. Everything completes in the call.
class CpuShardCompute final : public ShardCompute {
 public:
  using Allocator = absl::StatusOr<ShardBuffer> (*)(size_t, absl::string_view);
  CpuShardCompute(MemoryTier tier, Allocator allocate) : tier_(tier), allocate_(allocate) {}

  MemoryTier tier() const override { return tier_; }
  absl::StatusOr<ShardBuffer> AllocateShard(size_t bytes, absl::string_view what) override {
    return allocate_(bytes, what);
  }
  absl::StatusOr<ShardBuffer> AllocateStaging(size_t bytes, absl::string_view what) override {
    return allocate_(bytes, what);
  }

  absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                    int64_t numel) override {
    return kernels::cpu::Cast(src_dtype, src, dst_dtype, dst, numel);
  }
  absl::Status Reduce(absl::Span<const kernels::Contribution> contributions, float* dst,
                      int64_t numel, float alpha) override {
    return kernels::cpu::Reduce(contributions, absl::MakeSpan(dst, numel), alpha);
  }
  absl::Status Scale(float* x, int64_t numel, float alpha) override {
    kernels::cpu::Scale(absl::MakeSpan(x, numel), alpha);
    return absl::OkStatus();
  }
  absl::Status SgdStep(const kernels::SgdHyperparams& hp, bool first_step, float* param,
                       const float* grad, float* momentum_buffer, int64_t numel) override {
    kernels::cpu::SgdStep(hp, first_step, absl::MakeSpan(param, numel), absl::MakeConstSpan(grad, numel),
                          absl::MakeSpan(momentum_buffer, momentum_buffer ? numel : 0));
    return absl::OkStatus();
  }
  absl::Status AdamStep(const kernels::AdamHyperparams& hp, int64_t step, float* param,
                        const float* grad, float* exp_avg, float* exp_avg_sq,
                        float* max_exp_avg_sq, int64_t numel) override {
    kernels::cpu::AdamStep(hp, step, absl::MakeSpan(param, numel), absl::MakeConstSpan(grad, numel),
                           absl::MakeSpan(exp_avg, numel), absl::MakeSpan(exp_avg_sq, numel),
                           absl::MakeSpan(max_exp_avg_sq, max_exp_avg_sq ? numel : 0));
    return absl::OkStatus();
  }
  absl::StatusOr<double> NormPartial(const float* x, int64_t numel, double norm_type) override {
    const absl::Span<const float> values(x, numel);
    if (std::isinf(norm_type)) return static_cast<double>(kernels::cpu::MaxAbs(values));
    return kernels::cpu::SquaredNorm(values);
  }
  absl::Status CopyToHost(const float* shard, float* host, int64_t numel) override {
    if (numel > 0) std::memcpy(host, shard, numel * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(const float* host, float* shard, int64_t numel) override {
    if (numel > 0) std::memcpy(shard, host, numel * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Zero(float* shard, int64_t numel) override {
    if (numel > 0) std::memset(shard, 0, numel * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status CopyBytes(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  const MemoryTier tier_;
  const Allocator allocate_;
};

#if !FLATSHARD_HAVE_CUDA
absl::Status NoCudaInThisBuild(absl::string_view name) {
  return absl::FailedPreconditionError(absl::StrCat(
      "--memory=", name, " needs CUDA, and this build has none (configure with FLATSHARD_CUDA=ON); use --memory=host"));
}
#endif

}  // namespace

// Large buffers are 2 MiB-aligned and advised for huge pages (core/huge_pages.h): shards
// are first written all at once. Small ones stay on plain pages, so that many small
// groups do not take 2 MiB each.
absl::StatusOr<ShardBuffer> AllocateHostUnwritten(size_t bytes, absl::string_view what) {
  if (bytes == 0) return ShardBuffer();
  constexpr size_t kAlign = size_t{2} << 20;
  const bool huge = bytes >= 4 * kAlign;
  const size_t rounded = huge ? (bytes + kAlign - 1) / kAlign * kAlign : bytes;
  void* data = huge ? std::aligned_alloc(kAlign, rounded) : std::malloc(bytes);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes of host memory for ", what, " failed"));
  }
  if (huge) AdviseHugePages(data, rounded);
  return ShardBuffer(data, bytes, &FreeHost);
}

absl::string_view MemoryTierName(MemoryTier tier) {
  switch (tier) {
    case MemoryTier::kHost:
      return "host";
    case MemoryTier::kPinned:
      return "pinned";
    case MemoryTier::kDevice:
      return "device";
  }
  return "unknown";
}

absl::StatusOr<MemoryTier> ParseMemoryTier(absl::string_view name) {
  if (name == "host") return MemoryTier::kHost;
  if (name != "pinned" && name != "device") {
    return absl::InvalidArgumentError(
        absl::StrCat("--memory=", name, ": expected host, pinned or device"));
  }
#if FLATSHARD_HAVE_CUDA
  absl::Status device = internal::CheckCudaDevice();
  if (!device.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("--memory=", name, ": ", device.message()));
  }
  return name == "pinned" ? MemoryTier::kPinned : MemoryTier::kDevice;
#else
  return NoCudaInThisBuild(name);
#endif
}

absl::StatusOr<std::unique_ptr<ShardCompute>> MakeShardCompute(MemoryTier tier) {
  switch (tier) {
    case MemoryTier::kHost:
      return std::make_unique<CpuShardCompute>(tier, &AllocateHost);
#if FLATSHARD_HAVE_CUDA
    case MemoryTier::kPinned:
      return std::make_unique<CpuShardCompute>(tier, &internal::AllocatePinned);
    case MemoryTier::kDevice:
      return internal::MakeCudaShardCompute();
#else
    case MemoryTier::kPinned:
    case MemoryTier::kDevice:
      return NoCudaInThisBuild(MemoryTierName(tier));
#endif
  }
  return absl::InvalidArgumentError("unknown memory tier");
}

}  // namespace flatshard::server
