// kernels::cpu::Reduce against a float64 reference (within float32 summation error) and
// against the kernels it fuses (Cast, Accumulate per further worker, Scale), bit for bit,
// for mixed dtypes, worker counts past one GPU launch's 8 sources and sizes that are not
// a multiple of its block.
#include "kernels/cpu/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/float_bits.h"
#include "kernels/cpu/accumulate.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/scale.h"

namespace flatshard::kernels::cpu {
namespace {

// One worker's gradient: float32 values and, for 16-bit dtypes, their bits.
struct Gradient {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> bits;
  const void* data() const { return dtype == DType::kFloat32 ? static_cast<const void*>(f32.data()) : bits.data(); }
  double at(size_t i) const {
    switch (dtype) {
      case DType::kFloat32: return f32[i];
      case DType::kBFloat16: return BFloat16BitsToFloat(bits[i]);
      default: return HalfBitsToFloat(bits[i]);
    }
  }
};

std::vector<Gradient> RandomGradients(std::mt19937& rng, int workers, size_t n) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  std::vector<Gradient> grads;
  for (int w = 0; w < workers; ++w) {
    Gradient g{dtypes[(w + rng()) % 3], std::vector<float>(n), {}};
    for (float& x : g.f32) x = normal(rng);
    if (g.dtype != DType::kFloat32) {
      g.bits.resize(n);
      EXPECT_TRUE(Cast(DType::kFloat32, g.f32.data(), g.dtype, g.bits.data(), n).ok());
    }
    grads.push_back(std::move(g));
  }
  return grads;
}

TEST(ReduceKernelTest, EqualsCastAccumulateScaleBitwiseAndFloat64WithinRounding) {
  std::mt19937 rng(std::random_device{}());
  for (int workers : {1, 2, 3, 11}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{16 * 1024}, size_t{2 * 16 * 1024 + 13}}) {
      const std::vector<Gradient> grads = RandomGradients(rng, workers, n);
      std::vector<Contribution> contributions;
      for (const Gradient& g : grads) contributions.push_back({g.dtype, g.data()});
      for (float alpha : {1.0f, 1.0f / static_cast<float>(workers)}) {
        std::vector<float> got(n, std::numeric_limits<float>::quiet_NaN());  // poison
        ASSERT_TRUE(Reduce(contributions, absl::MakeSpan(got), alpha).ok());

        std::vector<float> composed(n);
        ASSERT_TRUE(Cast(grads[0].dtype, grads[0].data(), DType::kFloat32, composed.data(), n).ok());
        for (int w = 1; w < workers; ++w) {
          ASSERT_TRUE(Accumulate(grads[w].dtype, grads[w].data(), absl::MakeSpan(composed)).ok());
        }
        if (alpha != 1.0f) Scale(absl::MakeSpan(composed), alpha);
        ASSERT_TRUE(n == 0 || std::memcmp(got.data(), composed.data(), n * sizeof(float)) == 0)  // no null to memcmp
            << workers << " workers, " << n << " elements, alpha " << alpha;

        for (size_t i = 0; i < n; ++i) {
          double sum = 0, magnitude = 0;
          for (const Gradient& g : grads) {
            sum += g.at(i);
            magnitude += std::fabs(g.at(i));
          }
          // One float32 rounding per addition and one for the product.
          const double bound = (workers + 1) * std::ldexp(magnitude * alpha, -24);
          ASSERT_NEAR(got[i], sum * alpha, bound) << workers << " workers, element " << i;
        }
      }
    }
  }
}

TEST(ReduceKernelTest, RefusesNothingAndNonFloatDtypes) {
  std::vector<float> dst(4, 7.0f);
  EXPECT_EQ(Reduce({}, absl::MakeSpan(dst), 1.0f).code(), absl::StatusCode::kInvalidArgument);
  const int32_t ints[4] = {1, 2, 3, 4};
  const float floats[4] = {1, 2, 3, 4};
  const Contribution bad[] = {{DType::kFloat32, floats}, {DType::kInt32, ints}};
  const absl::Status status = Reduce(bad, absl::MakeSpan(dst), 1.0f);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("int32"), absl::string_view::npos) << status;
  EXPECT_EQ(dst, std::vector<float>(4, 7.0f));  // nothing written
}

}  // namespace
}  // namespace flatshard::kernels::cpu
