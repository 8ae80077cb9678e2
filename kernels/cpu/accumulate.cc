#include "kernels/cpu/accumulate.h"

#include "absl/strings/str_cat.h"
#include "core/float_bits.h"
#include "kernels/cpu/multiversion.h"

namespace flatshard::kernels::cpu {

FLATSHARD_MULTIVERSION void AccumulateFloat32(absl::Span<const float> src, absl::Span<float> dst) {
  const float* in = src.data();
  float* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] += in[i];
}

FLATSHARD_MULTIVERSION void AccumulateBFloat16(absl::Span<const uint16_t> src, absl::Span<float> dst) {
  const uint16_t* in = src.data();
  float* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] += BFloat16BitsToFloat(in[i]);
}

FLATSHARD_MULTIVERSION void AccumulateFloat16(absl::Span<const uint16_t> src, absl::Span<float> dst) {
  const uint16_t* in = src.data();
  float* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] += HalfBitsToFloat(in[i]);
}

absl::Status Accumulate(DType src_dtype, const void* src, absl::Span<float> dst) {
  const size_t n = dst.size();
  switch (src_dtype) {
    case DType::kFloat32:
      AccumulateFloat32(absl::MakeConstSpan(static_cast<const float*>(src), n), dst);
      return absl::OkStatus();
    case DType::kBFloat16:
      AccumulateBFloat16(absl::MakeConstSpan(static_cast<const uint16_t*>(src), n), dst);
      return absl::OkStatus();
    case DType::kFloat16:
      AccumulateFloat16(absl::MakeConstSpan(static_cast<const uint16_t*>(src), n), dst);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot accumulate ", DTypeName(src_dtype), " gradients"));
  }
}

}  // namespace flatshard::kernels::cpu
