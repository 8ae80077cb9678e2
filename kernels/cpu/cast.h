// CPU cast kernels between float32 and the 16-bit float formats, stored as raw uint16_t
// bit patterns. Rounding and special values as core/float_bits.h states (PyTorch's
// `.to()`). The loops vectorize. Thread-safe; callers own the buffers, which must not
// overlap.
//
//   kernels::cpu::CastFloat32ToBFloat16(master, absl::MakeSpan(bf16_out));
#ifndef FLATSHARD_KERNELS_CPU_CAST_H_
#define FLATSHARD_KERNELS_CPU_CAST_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace flatshard::kernels::cpu {

// Preconditions for the typed casts: dst.size() == src.size().
void CastFloat32ToBFloat16(absl::Span<const float> src, absl::Span<uint16_t> dst);
// On x86-64 CPUs with F16C, by the conversion instruction; bitwise equal to:
void CastFloat32ToFloat16(absl::Span<const float> src, absl::Span<uint16_t> dst);
// the portable loop over FloatToHalfBits (every other CPU).
void CastFloat32ToFloat16Portable(absl::Span<const float> src, absl::Span<uint16_t> dst);
void CastBFloat16ToFloat32(absl::Span<const uint16_t> src, absl::Span<float> dst);
void CastFloat16ToFloat32(absl::Span<const uint16_t> src, absl::Span<float> dst);

// Converts `numel` elements of `src_dtype` at `src` into `dst_dtype` at `dst`, where at
// least one side is float32 and both are float32, bfloat16 or float16 (float32 to
// float32 is a copy). Returns InvalidArgument for any other pair, writing nothing.
[[nodiscard]] absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                                int64_t numel);

}  // namespace flatshard::kernels::cpu

#endif  // FLATSHARD_KERNELS_CPU_CAST_H_
