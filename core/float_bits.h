// Scalar conversions between float32 and the 16-bit float formats, on raw bit patterns.
//
// Header-only and branch-light so that the loops in kernels/ that call them vectorize.
// Semantics follow PyTorch's scalar c10::BFloat16 / c10::Half constructors (`.to()`):
//  - float32 -> bfloat16 and -> float16 round to nearest, ties to even;
//  - overflow of float16 (|x| >= 65520) gives +-Inf; subnormal results are exact (no FTZ);
//  - NaN gives the canonical quiet NaN: 0x7FC0 for bfloat16 (sign dropped, as c10 does),
//    sign | 0x7E00 for float16;
//  - widening (16 -> 32 bits) is exact for every input, NaN payloads included.
// All functions are pure and thread-safe, and the CUDA kernels call the same code.
//
//   uint16_t h = FloatToHalfBits(1.0f);      // 0x3C00
//   float f = BFloat16BitsToFloat(0x3F80);   // 1.0f
#ifndef FLATSHARD_CORE_FLOAT_BITS_H_
#define FLATSHARD_CORE_FLOAT_BITS_H_

#include <algorithm>
#include <bit>
#include <cstdint>

#include "core/host_device.h"

namespace flatshard {
namespace internal {

// `if_true` where `condition`, else `if_false`, as bit masks: GCC if-converts and
// vectorizes this where it turns ternaries back into branches.
FLATSHARD_HOST_DEVICE inline uint32_t SelectBits(bool condition, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = 0u - static_cast<uint32_t>(condition);
  return (if_true & mask) | (if_false & ~mask);
}

}  // namespace internal

FLATSHARD_HOST_DEVICE inline uint16_t FloatToBFloat16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to even; carries
  // into the exponent give the next binade or Inf, as they should.
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return is_nan ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

FLATSHARD_HOST_DEVICE inline float BFloat16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

FLATSHARD_HOST_DEVICE inline uint16_t FloatToHalfBits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;

  // Normal results: rebias the exponent (127 -> 15) and round 23 -> 10 mantissa bits.
  const uint32_t rebiased = magnitude - (112u << 23);
  const uint32_t normal = (rebiased + 0x0FFFu + ((rebiased >> 13) & 1u)) >> 13;

  // Subnormal results: the value in units of 2^-24 is mantissa_with_hidden >> shift,
  // rounded to nearest even on the bits shifted out. shift is 14..24 for exponents
  // 102..112, the only ones that use it; clamping to [1, 25] keeps every shift defined.
  const int32_t exponent = static_cast<int32_t>(magnitude >> 23);
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  const int32_t unclamped_shift = 126 - exponent;
  const uint32_t shift = static_cast<uint32_t>(std::min(std::max(unclamped_shift, 1), 25));
  const uint32_t kept = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t round_up =
      static_cast<uint32_t>(rest > half) | (static_cast<uint32_t>(rest == half) & kept);
  const uint32_t subnormal = kept + (round_up & 1u);

  // Selects without branches so that loops over this function vectorize.
  using internal::SelectBits;
  uint32_t result = SelectBits(magnitude >= 0x33000000u, subnormal, 0u);  // >= 2^-25, else 0
  result = SelectBits(magnitude >= 0x38800000u, normal, result);          // >= 2^-14: normal
  result = SelectBits(magnitude >= 0x477FF000u, 0x7C00u, result);  // rounds past 65504: Inf
  result = SelectBits(magnitude > 0x7F800000u, 0x7E00u, result);   // NaN
  return static_cast<uint16_t>(sign | result);
}

FLATSHARD_HOST_DEVICE inline float HalfBitsToFloat(uint16_t bits) {
  const uint32_t sign = (static_cast<uint32_t>(bits) & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t mantissa = bits & 0x3FFu;
  const uint32_t special = 0x7F800000u | (mantissa << 13);  // Inf / NaN, payload kept
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  // Zero or subnormal: mantissa * 2^-24 is exact in float32.
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 0x1.0p-24f);
  using internal::SelectBits;
  const uint32_t magnitude =
      SelectBits(exponent == 0x1Fu, special, SelectBits(exponent != 0, normal, subnormal));
  return std::bit_cast<float>(sign | magnitude);
}

}  // namespace flatshard

#endif  // FLATSHARD_CORE_FLOAT_BITS_H_
