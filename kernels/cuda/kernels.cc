#include "kernels/cuda/kernels.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda/launch.h"

namespace flatshard::kernels::cuda {
namespace {

using internal::HalfKind;

absl::Status FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, " failed: ", cudaGetErrorString(err)));
}

absl::Status CheckNumel(int64_t numel) {
  if (numel < 0) return absl::InvalidArgumentError(absl::StrCat("negative element count ", numel));
  return absl::OkStatus();
}

bool IsHalf(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }
HalfKind KindOf(DType dtype) {
  return dtype == DType::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16;
}

}  // namespace

absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst, int64_t numel,
                  cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  if (src_dtype == DType::kFloat32 && dst_dtype == DType::kFloat32) {
    return FromCuda(cudaMemcpyAsync(dst, src, numel * sizeof(float), cudaMemcpyDefault, stream),
                    "cudaMemcpyAsync");
  }
  if (src_dtype == DType::kFloat32 && IsHalf(dst_dtype)) {
    return FromCuda(internal::LaunchCastToHalf(KindOf(dst_dtype), static_cast<const float*>(src),
                                               static_cast<uint16_t*>(dst), numel, stream),
                    "cast kernel");
  }
  if (IsHalf(src_dtype) && dst_dtype == DType::kFloat32) {
    return FromCuda(
        internal::LaunchCastFromHalf(KindOf(src_dtype), static_cast<const uint16_t*>(src),
                                     static_cast<float*>(dst), numel, stream),
        "cast kernel");
  }
  return absl::InvalidArgumentError(absl::StrCat("cannot cast ", DTypeName(src_dtype), " to ",
                                                 DTypeName(dst_dtype), " on the GPU"));
}

absl::Status Accumulate(DType src_dtype, const void* src, float* dst, int64_t numel,
                        cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  if (src_dtype == DType::kFloat32) {
    return FromCuda(internal::LaunchAccumulateFloat32(static_cast<const float*>(src), dst, numel,
                                                      stream),
                    "accumulate kernel");
  }
  if (IsHalf(src_dtype)) {
    return FromCuda(internal::LaunchAccumulateHalf(KindOf(src_dtype),
                                                   static_cast<const uint16_t*>(src), dst, numel,
                                                   stream),
                    "accumulate kernel");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cannot accumulate ", DTypeName(src_dtype), " gradients"));
}

absl::Status Scale(float* x, int64_t numel, float alpha, cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  return FromCuda(internal::LaunchScale(x, numel, alpha, stream), "scale kernel");
}

absl::Status Reduce(absl::Span<const Contribution> contributions, float* dst, int64_t numel,
                    float alpha, cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  if (contributions.empty()) return absl::InvalidArgumentError("nothing to reduce");
  for (const Contribution& c : contributions) {
    if (c.dtype != DType::kFloat32 && !IsHalf(c.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot reduce ", DTypeName(c.dtype), " gradients"));
    }
  }
  for (size_t first = 0; first < contributions.size(); first += internal::kMaxReduceSources) {
    internal::ReduceSources sources;
    for (size_t j = first; j < contributions.size() && sources.count < internal::kMaxReduceSources; ++j) {
      const DType dtype = contributions[j].dtype;
      sources.data[sources.count] = contributions[j].data;
      sources.kind[sources.count++] = dtype == DType::kFloat32    ? internal::SourceKind::kFloat32
                                      : dtype == DType::kBFloat16 ? internal::SourceKind::kBFloat16
                                                                  : internal::SourceKind::kFloat16;
    }
    const bool last = first + internal::kMaxReduceSources >= contributions.size();
    FLATSHARD_RETURN_IF_ERROR(FromCuda(
        internal::LaunchReduce(sources, /*accumulate=*/first > 0, last && alpha != 1.0f, alpha,
                               dst, numel, stream),
        "reduce kernel"));
  }
  return absl::OkStatus();
}

absl::Status SquaredNorm(const float* x, int64_t numel, double* result, cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  return FromCuda(internal::LaunchSquaredNorm(x, numel, result, stream), "norm kernel");
}

absl::Status MaxAbs(const float* x, int64_t numel, float* result, cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  return FromCuda(internal::LaunchMaxAbs(x, numel, result, stream), "max-abs kernel");
}

absl::Status SgdStep(const SgdHyperparams& hp, bool first_step, float* param, const float* grad,
                     float* momentum_buffer, int64_t numel, cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  return FromCuda(
      internal::LaunchSgd(hp, first_step, param, grad, momentum_buffer, numel, stream),
      "SGD kernel");
}

absl::Status AdamStep(const AdamHyperparams& hp, int64_t step, float* param, const float* grad,
                      float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, int64_t numel,
                      cudaStream_t stream) {
  FLATSHARD_RETURN_IF_ERROR(CheckNumel(numel));
  if (step < 1) return absl::InvalidArgumentError(absl::StrCat("Adam step ", step, " < 1"));
  return FromCuda(internal::LaunchAdam(MakeAdamScalars(hp, step), param, grad, exp_avg,
                                       exp_avg_sq, max_exp_avg_sq, numel, stream),
                  "Adam kernel");
}

}  // namespace flatshard::kernels::cuda
