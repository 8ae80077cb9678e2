#include "core/float_bits.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <vector>

namespace flatshard {
namespace {

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }

struct Case {
  uint32_t input;
  uint16_t expected;
};

TEST(FloatBitsTest, BFloat16ExplicitPatterns) {
  const Case cases[] = {
      {0x3F800000, 0x3F80},  // 1.0
      {0xBF800000, 0xBF80},  // -1.0
      {0x3F808000, 0x3F80},  // tie, kept bit even: down
      {0x3F818000, 0x3F82},  // tie, kept bit odd: up
      {0x3F808001, 0x3F81},  // above the tie: up
      {0x3F807FFF, 0x3F80},  // below the tie: down
      {0x7F7FFFFF, 0x7F80},  // FLT_MAX rounds to +Inf
      {0x7F800000, 0x7F80},  // +Inf
      {0xFF800000, 0xFF80},  // -Inf
      {0x7FC00000, 0x7FC0},  // quiet NaN
      {0xFFC00001, 0x7FC0},  // negative NaN: canonical (c10 drops the sign)
      {0x7F800001, 0x7FC0},  // signalling NaN: canonical quiet NaN
      {0x00000000, 0x0000},  // +0
      {0x80000000, 0x8000},  // -0
      {0x00000001, 0x0000},  // smallest subnormal rounds to zero
      {0x00008000, 0x0000},  // subnormal tie, even: down
      {0x00018000, 0x0002},  // subnormal tie, odd: up
      {0x0000C000, 0x0001},  // subnormal above half
      {0x007FFFFF, 0x0080},  // largest subnormal rounds into the normals
      {0x3DCCCCCD, 0x3DCD},  // 0.1f
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToBFloat16Bits(FromBits(c.input)), c.expected) << std::hex << c.input;
  }
}

TEST(FloatBitsTest, Float16ExplicitPatterns) {
  const Case cases[] = {
      {0x3F800000, 0x3C00},  // 1.0
      {0xC0000000, 0xC000},  // -2.0
      {0x3DCCCCCD, 0x2E66},  // 0.1f
      {0x477FE000, 0x7BFF},  // 65504, the largest finite half
      {0x477FEFFF, 0x7BFF},  // just below 65520
      {0x477FF000, 0x7C00},  // 65520: tie with an odd kept bit -> Inf
      {0x7F7FFFFF, 0x7C00},  // FLT_MAX overflows to Inf
      {0xC7800000, 0xFC00},  // -65536 -> -Inf
      {0x7F800000, 0x7C00},  // +Inf
      {0xFF800000, 0xFC00},  // -Inf
      {0x7FC00000, 0x7E00},  // NaN
      {0xFFC00000, 0xFE00},  // -NaN keeps its sign
      {0x7F800001, 0x7E00},  // signalling NaN: quiet
      {0x3F801000, 0x3C00},  // 1 + 2^-11: tie, even: down
      {0x3F803000, 0x3C02},  // 1 + 3*2^-11: tie, odd: up
      {0x38800000, 0x0400},  // 2^-14, the smallest normal
      {0x387FC000, 0x03FF},  // 1023 * 2^-24, the largest subnormal
      {0x387FE000, 0x0400},  // 1023.5 * 2^-24: tie rounds up into the normals
      {0x33800000, 0x0001},  // 2^-24, the smallest subnormal
      {0xB3800000, 0x8001},  // -2^-24
      {0x33000000, 0x0000},  // 2^-25: tie, even: zero
      {0x33000001, 0x0001},  // just above 2^-25
      {0x33C00000, 0x0002},  // 1.5 * 2^-24: tie, odd: up
      {0x32800000, 0x0000},  // 2^-26
      {0x00000001, 0x0000},  // float32 subnormal
      {0x80000000, 0x8000},  // -0
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToHalfBits(FromBits(c.input)), c.expected) << std::hex << c.input;
  }
}

TEST(FloatBitsTest, WideningIsExactForEveryPattern) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const uint16_t pattern = static_cast<uint16_t>(bits);
    const float from_half = HalfBitsToFloat(pattern);
    const float from_bf16 = BFloat16BitsToFloat(pattern);
    if (((bits >> 10) & 0x1F) == 0x1F && (bits & 0x3FF) != 0) {
      EXPECT_TRUE(std::isnan(from_half)) << bits;
    } else {
      EXPECT_EQ(FloatToHalfBits(from_half), pattern) << std::hex << bits;
    }
    if (((bits >> 7) & 0xFF) == 0xFF && (bits & 0x7F) != 0) {
      EXPECT_TRUE(std::isnan(from_bf16)) << bits;
    } else {
      EXPECT_EQ(FloatToBFloat16Bits(from_bf16), pattern) << std::hex << bits;
    }
  }
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0x8400), -std::ldexp(1.0f, -14));
  EXPECT_TRUE(std::signbit(HalfBitsToFloat(0x8000)));
}

// Independent reference: the nearest representable value by search over every finite
// half / bfloat16 (computed in double), ties to the even pattern, Inf past the midpoint
// above the largest finite value.
uint16_t NearestBySearch(float value, const std::vector<std::pair<double, uint16_t>>& table,
                         double overflow_threshold, uint16_t inf_bits) {
  const double magnitude = std::fabs(static_cast<double>(value));
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (magnitude >= overflow_threshold) return sign | inf_bits;
  auto above = std::lower_bound(table.begin(), table.end(), std::make_pair(magnitude, uint16_t{0}));
  auto below = above == table.begin() ? above : std::prev(above);
  if (above == table.end()) above = below;
  const double d_below = magnitude - below->first;
  const double d_above = above->first - magnitude;
  uint16_t chosen;
  if (d_below < d_above) {
    chosen = below->second;
  } else if (d_above < d_below) {
    chosen = above->second;
  } else {
    chosen = (below->second & 1) == 0 ? below->second : above->second;
  }
  return sign | chosen;
}

TEST(FloatBitsTest, RandomFloatsMatchNearestSearchReference) {
  std::vector<std::pair<double, uint16_t>> halves;
  std::vector<std::pair<double, uint16_t>> bf16s;
  for (uint16_t bits = 0; bits < 0x7C00; ++bits) halves.emplace_back(HalfBitsToFloat(bits), bits);
  for (uint16_t bits = 0; bits < 0x7F80; ++bits) bf16s.emplace_back(BFloat16BitsToFloat(bits), bits);
  const double half_overflow = 65504.0 + 16.0;  // midpoint to the next (absent) step
  const double bf16_overflow = static_cast<double>(BFloat16BitsToFloat(0x7F7F)) +
                               std::ldexp(1.0, 127 - 8);

  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = any_bits(rng);
    // Half the samples in the float16 range, where the interesting rounding happens.
    if (i % 2 == 0) bits = (bits & 0x807FFFFFu) | ((100u + bits % 45u) << 23);
    const float value = FromBits(bits);
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToHalfBits(value), NearestBySearch(value, halves, half_overflow, 0x7C00))
        << std::hex << bits;
    ASSERT_EQ(FloatToBFloat16Bits(value), NearestBySearch(value, bf16s, bf16_overflow, 0x7F80))
        << std::hex << bits;
  }
}

}  // namespace
}  // namespace flatshard
