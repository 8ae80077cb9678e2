#include "kernels/cpu/cast.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "core/float_bits.h"

namespace flatshard::kernels::cpu {
namespace {

// Random bit patterns (every class: NaN, Inf, subnormal, normal) at odd lengths so the
// vector loops' tails run too.
std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> values(n);
  for (float& v : values) v = std::bit_cast<float>(bits(rng));
  return values;
}

TEST(CastKernelTest, NarrowingMatchesScalarConversionBitwise) {
  for (size_t n : {0u, 1u, 7u, 64u, 1001u}) {
    const std::vector<float> src = RandomFloats(n, 7 + n);
    std::vector<uint16_t> bf16(n, 0xDEAD), half(n, 0xDEAD);
    CastFloat32ToBFloat16(src, absl::MakeSpan(bf16));
    CastFloat32ToFloat16(src, absl::MakeSpan(half));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(bf16[i], FloatToBFloat16Bits(src[i])) << i;
      ASSERT_EQ(half[i], FloatToHalfBits(src[i])) << i;
    }
  }
}

// The F16C path (where the CPU has it) against the portable loop, for every float32 bit
// pattern: both signs of every exponent, every mantissa, so every tie, subnormal,
// overflow and NaN payload. Blocks of 2^16 patterns start at odd offsets so the
// vector loop's tail runs too.
TEST(CastKernelTest, Float16NarrowingEqualsThePortableLoopForEveryFloat) {
  constexpr size_t kBlock = size_t{1} << 16;
  std::vector<float> src(kBlock + 3);
  std::vector<uint16_t> fast(src.size()), portable(src.size());
  for (uint64_t high = 0; high < (uint64_t{1} << 32); high += kBlock) {
    for (size_t i = 0; i < kBlock; ++i) src[i + 3] = std::bit_cast<float>(static_cast<uint32_t>(high + i));
    const auto in = absl::MakeConstSpan(src).subspan(3);
    CastFloat32ToFloat16(in, absl::MakeSpan(fast).subspan(3));
    CastFloat32ToFloat16Portable(in, absl::MakeSpan(portable).subspan(3));
    if (fast != portable) {
      for (size_t i = 3; i < src.size(); ++i) {
        ASSERT_EQ(fast[i], portable[i]) << "float bits 0x" << std::hex << std::bit_cast<uint32_t>(src[i]);
      }
    }
  }
}

TEST(CastKernelTest, WideningMatchesScalarConversionBitwise) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> from_bf16(all.size(), -1.0f), from_half(all.size(), -1.0f);
  CastBFloat16ToFloat32(all, absl::MakeSpan(from_bf16));
  CastFloat16ToFloat32(all, absl::MakeSpan(from_half));
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(from_bf16[i]),
              std::bit_cast<uint32_t>(BFloat16BitsToFloat(all[i])));
    ASSERT_EQ(std::bit_cast<uint32_t>(from_half[i]),
              std::bit_cast<uint32_t>(HalfBitsToFloat(all[i])));
  }
}

TEST(CastKernelTest, DispatchCoversEveryFloatPairAndRefusesOthers) {
  const std::vector<float> src = {1.0f, -2.5f, 65504.0f};
  std::vector<uint16_t> half(3);
  ASSERT_TRUE(Cast(DType::kFloat32, src.data(), DType::kFloat16, half.data(), 3).ok());
  EXPECT_EQ(half, (std::vector<uint16_t>{0x3C00, 0xC100, 0x7BFF}));
  std::vector<float> back(3);
  ASSERT_TRUE(Cast(DType::kFloat16, half.data(), DType::kFloat32, back.data(), 3).ok());
  EXPECT_EQ(back, src);
  std::vector<float> copy(3);
  ASSERT_TRUE(Cast(DType::kFloat32, src.data(), DType::kFloat32, copy.data(), 3).ok());
  EXPECT_EQ(copy, src);

  absl::Status status = Cast(DType::kBFloat16, half.data(), DType::kFloat16, half.data(), 3);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "no cast from bfloat16 to float16");
  EXPECT_FALSE(Cast(DType::kFloat32, src.data(), DType::kInt32, copy.data(), 3).ok());
  EXPECT_FALSE(Cast(DType::kFloat32, src.data(), DType::kFloat32, copy.data(), -1).ok());
}

}  // namespace
}  // namespace flatshard::kernels::cpu
