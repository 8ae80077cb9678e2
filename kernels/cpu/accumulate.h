// CPU kernels that add gradients of any float dtype into a float32 accumulator
// (dst[i] += float(src[i]), one rounding per element, in index order). The loops
// vectorize. Thread-safe; callers own the buffers, which must not overlap.
//
//   kernels::cpu::AccumulateBFloat16(grad_bf16, absl::MakeSpan(accumulator));
#ifndef FLATSHARD_KERNELS_CPU_ACCUMULATE_H_
#define FLATSHARD_KERNELS_CPU_ACCUMULATE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace flatshard::kernels::cpu {

// Preconditions: dst.size() == src.size().
void AccumulateFloat32(absl::Span<const float> src, absl::Span<float> dst);
void AccumulateBFloat16(absl::Span<const uint16_t> src, absl::Span<float> dst);
void AccumulateFloat16(absl::Span<const uint16_t> src, absl::Span<float> dst);

// Adds `dst.size()` elements of `src_dtype` at `src` into `dst`. Returns
// InvalidArgument unless src_dtype is float32, bfloat16 or float16.
[[nodiscard]] absl::Status Accumulate(DType src_dtype, const void* src, absl::Span<float> dst);

}  // namespace flatshard::kernels::cpu

#endif  // FLATSHARD_KERNELS_CPU_ACCUMULATE_H_
