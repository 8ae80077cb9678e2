// CUDA kernels with the CPU kernels' semantics (kernels/kernels.h), enqueued on a stream:
// casts, gradient accumulation and reduction, scaling, norms and the fused optimizer
// updates. Every
// pointer is device memory (or memory the device can address) owned by the caller;
// nothing here synchronizes with the host, so a caller chains kernels on one stream and
// synchronizes once. Each function returns the launch error, if any (Internal with the
// CUDA message), or InvalidArgument for an unsupported dtype, launching nothing.
//
// Results are bit for bit the CPU kernels' for casts, accumulation, reduction, scaling and
// the optimizers (shared element code: core/float_bits.h, kernels/optimizer_math.h). Norms
// reduce in a different order: SquaredNorm agrees with the CPU to double rounding,
// MaxAbs exactly. Loads and stores are 16 bytes wide (8 for 16-bit outputs) when every
// pointer of the call is aligned for it, element-wise otherwise.
// Thread-safe: calls on different streams may come from different threads.
//
//   FLATSHARD_RETURN_IF_ERROR(kernels::cuda::Accumulate(DType::kBFloat16, grad, acc, n, s));
//   FLATSHARD_RETURN_IF_ERROR(kernels::cuda::AdamStep(adamw, step, p, acc, m, v, nullptr, n, s));
#ifndef FLATSHARD_KERNELS_CUDA_KERNELS_H_
#define FLATSHARD_KERNELS_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "absl/types/span.h"
#include "kernels/contribution.h"
#include "kernels/hyperparams.h"

namespace flatshard::kernels::cuda {

// dst (dst_dtype) = src (src_dtype) for `numel` elements; one side float32, the other
// float32, bfloat16 or float16 (round to nearest even, NaN and Inf kept).
[[nodiscard]] absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                                int64_t numel, cudaStream_t stream);

// dst[i] += float(src[i]) for src of float32, bfloat16 or float16.
[[nodiscard]] absl::Status Accumulate(DType src_dtype, const void* src, float* dst, int64_t numel,
                                      cudaStream_t stream);

// x[i] *= alpha.
[[nodiscard]] absl::Status Scale(float* x, int64_t numel, float alpha, cudaStream_t stream);

// dst[i] = alpha * (c[0][i] + c[1][i] + ...) in contribution order, the product taken
// only when alpha != 1: bit for bit kernels::cpu::Reduce, reading each contribution once
// (one launch per 8 contributions). InvalidArgument when there is none or a dtype is not
// float32, bfloat16 or float16.
[[nodiscard]] absl::Status Reduce(absl::Span<const Contribution> contributions, float* dst,
                                  int64_t numel, float alpha, cudaStream_t stream);

// *result = sum of x[i]^2 in double; *result = max |x[i]| (NaN if any is NaN, 0 when
// empty). `result` is device memory; the value is there once the stream reaches it.
[[nodiscard]] absl::Status SquaredNorm(const float* x, int64_t numel, double* result,
                                       cudaStream_t stream);
[[nodiscard]] absl::Status MaxAbs(const float* x, int64_t numel, float* result,
                                  cudaStream_t stream);

// torch.optim.SGD on `numel` elements; momentum_buffer is used when momentum != 0.
[[nodiscard]] absl::Status SgdStep(const SgdHyperparams& hp, bool first_step, float* param,
                                   const float* grad, float* momentum_buffer, int64_t numel,
                                   cudaStream_t stream);

// torch.optim.Adam / AdamW for optimizer step `step` (1 for the first); max_exp_avg_sq
// is used only with amsgrad. One pass: reads p, g, m, v once, writes p, m, v once.
[[nodiscard]] absl::Status AdamStep(const AdamHyperparams& hp, int64_t step, float* param,
                                    const float* grad, float* exp_avg, float* exp_avg_sq,
                                    float* max_exp_avg_sq, int64_t numel, cudaStream_t stream);

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_KERNELS_H_
