#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/norm.h"
#include "kernels/cpu/scale.h"

namespace flatshard::kernels::cpu {
namespace {

std::vector<float> RandomNormal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

TEST(ScaleKernelTest, MultipliesEveryElementOnce) {
  std::vector<float> x = RandomNormal(1003, 1);
  const std::vector<float> original = x;
  Scale(absl::MakeSpan(x), 0.25f);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], original[i] * 0.25f);
}

TEST(NormKernelTest, SquaredNormAgreesWithLongDoubleReference) {
  for (size_t n : {0u, 1u, 15u, 16u, 17u, 100003u}) {
    const std::vector<float> x = RandomNormal(n, static_cast<uint32_t>(n));
    long double reference = 0;
    for (float v : x) reference += static_cast<long double>(v) * v;
    const double ours = SquaredNorm(x);
    // Double accumulation of n terms: relative error well under n * 2^-53.
    EXPECT_NEAR(ours, static_cast<double>(reference), 1e-13 * static_cast<double>(reference) + 1e-300)
        << n;
  }
}

TEST(NormKernelTest, MaxAbsAndSpecialValues) {
  EXPECT_EQ(MaxAbs({}), 0.0f);
  EXPECT_EQ(MaxAbs(std::vector<float>{1.0f, -7.5f, 3.0f}), 7.5f);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(MaxAbs(std::vector<float>{1.0f, -inf}), inf);
  EXPECT_TRUE(std::isnan(MaxAbs(std::vector<float>{nan, 1.0f})));
  EXPECT_TRUE(std::isnan(MaxAbs(std::vector<float>{inf, nan})));
  EXPECT_TRUE(std::isinf(SquaredNorm(std::vector<float>{inf, 1.0f})));
  EXPECT_TRUE(std::isnan(SquaredNorm(std::vector<float>{nan, 1.0f})));
}

}  // namespace
}  // namespace flatshard::kernels::cpu
