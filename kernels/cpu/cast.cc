#include "kernels/cpu/cast.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/float_bits.h"
#include "kernels/cpu/multiversion.h"

namespace flatshard::kernels::cpu {

FLATSHARD_MULTIVERSION void CastFloat32ToBFloat16(absl::Span<const float> src, absl::Span<uint16_t> dst) {
  const float* in = src.data();
  uint16_t* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] = FloatToBFloat16Bits(in[i]);
}

FLATSHARD_MULTIVERSION void CastFloat32ToFloat16(absl::Span<const float> src, absl::Span<uint16_t> dst) {
  const float* in = src.data();
  uint16_t* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] = FloatToHalfBits(in[i]);
}

FLATSHARD_MULTIVERSION void CastBFloat16ToFloat32(absl::Span<const uint16_t> src, absl::Span<float> dst) {
  const uint16_t* in = src.data();
  float* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] = BFloat16BitsToFloat(in[i]);
}

FLATSHARD_MULTIVERSION void CastFloat16ToFloat32(absl::Span<const uint16_t> src, absl::Span<float> dst) {
  const uint16_t* in = src.data();
  float* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] = HalfBitsToFloat(in[i]);
}

absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst, int64_t numel) {
  if (numel < 0) return absl::InvalidArgumentError(absl::StrCat("cast of ", numel, " elements"));
  const size_t n = static_cast<size_t>(numel);
  const auto f32_in = [&] { return absl::MakeConstSpan(static_cast<const float*>(src), n); };
  const auto f32_out = [&] { return absl::MakeSpan(static_cast<float*>(dst), n); };
  const auto u16_in = [&] { return absl::MakeConstSpan(static_cast<const uint16_t*>(src), n); };
  const auto u16_out = [&] { return absl::MakeSpan(static_cast<uint16_t*>(dst), n); };
  if (src_dtype == DType::kFloat32) {
    switch (dst_dtype) {
      case DType::kFloat32:
        if (n != 0) std::memcpy(dst, src, n * sizeof(float));
        return absl::OkStatus();
      case DType::kBFloat16:
        CastFloat32ToBFloat16(f32_in(), u16_out());
        return absl::OkStatus();
      case DType::kFloat16:
        CastFloat32ToFloat16(f32_in(), u16_out());
        return absl::OkStatus();
      default:
        break;
    }
  } else if (dst_dtype == DType::kFloat32) {
    switch (src_dtype) {
      case DType::kBFloat16:
        CastBFloat16ToFloat32(u16_in(), f32_out());
        return absl::OkStatus();
      case DType::kFloat16:
        CastFloat16ToFloat32(u16_in(), f32_out());
        return absl::OkStatus();
      default:
        break;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("no cast from ", DTypeName(src_dtype), " to ",
                                                 DTypeName(dst_dtype)));
}

}  // namespace flatshard::kernels::cpu
