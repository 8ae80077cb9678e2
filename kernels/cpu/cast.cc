#include "kernels/cpu/cast.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/float_bits.h"
#include "kernels/cpu/multiversion.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FLATSHARD_HAVE_F16C 1
#else
#define FLATSHARD_HAVE_F16C 0
#endif

namespace flatshard::kernels::cpu {
namespace {

#if FLATSHARD_HAVE_F16C
// float32 -> float16 by the F16C instruction, eight at a time: round to nearest even,
// subnormal results and overflow to Inf as IEEE 754 says, like FloatToHalfBits (MXCSR's
// FTZ does not apply to it, and float32 subnormal inputs become +-0 with or without
// DAZ). Only NaN differs, the instruction keeping part of the payload: NaN lanes get
// FloatToHalfBits's sign | 0x7E00. Tested bitwise against FloatToHalfBits over every
// float32.
__attribute__((target("avx2,f16c"))) void CastFloat32ToFloat16F16c(const float* in, uint16_t* out,
                                                                    size_t n) {
  const __m128i magnitude = _mm_set1_epi16(0x7FFF);
  const __m128i infinity = _mm_set1_epi16(0x7C00);
  const __m128i sign = _mm_set1_epi16(static_cast<int16_t>(0x8000));
  const __m128i quiet_nan = _mm_set1_epi16(0x7E00);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    // NaN: magnitude above Inf (a signed compare is right: magnitudes are < 0x8000).
    const __m128i is_nan = _mm_cmpgt_epi16(_mm_and_si128(half, magnitude), infinity);
    const __m128i nan = _mm_or_si128(_mm_and_si128(half, sign), quiet_nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_blendv_epi8(half, nan, is_nan));
  }
  for (; i < n; ++i) out[i] = FloatToHalfBits(in[i]);
}

bool HaveF16c() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return have;
}
#endif

}  // namespace

FLATSHARD_MULTIVERSION void CastFloat32ToFloat16Portable(absl::Span<const float> src,
                                                         absl::Span<uint16_t> dst) {
  const float* in = src.data();
  uint16_t* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] = FloatToHalfBits(in[i]);
}

FLATSHARD_MULTIVERSION void CastFloat32ToBFloat16(absl::Span<const float> src, absl::Span<uint16_t> dst) {
  const float* in = src.data();
  uint16_t* out = dst.data();
  for (size_t i = 0, n = src.size(); i < n; ++i) out[i] = FloatToBFloat16Bits(in[i]);
}

void CastFloat32ToFloat16(absl::Span<const float> src, absl::Span<uint16_t> dst) {
#if FLATSHARD_HAVE_F16C
  if (HaveF16c()) return CastFloat32ToFloat16F16c(src.data(), dst.data(), src.size());
#endif
  CastFloat32ToFloat16Portable(src, dst);
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
