#include "kernels/cpu/accumulate.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/float_bits.h"

namespace flatshard::kernels::cpu {
namespace {

TEST(AccumulateKernelTest, EveryDTypeMatchesScalarReferenceBitwise) {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (size_t n : {0u, 1u, 15u, 16u, 17u, 4099u}) {
    std::vector<float> base(n), grad(n);
    for (size_t i = 0; i < n; ++i) {
      base[i] = normal(rng);
      grad[i] = normal(rng);
    }
    std::vector<uint16_t> grad_bf16(n), grad_half(n);
    for (size_t i = 0; i < n; ++i) {
      grad_bf16[i] = FloatToBFloat16Bits(grad[i]);
      grad_half[i] = FloatToHalfBits(grad[i]);
    }
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      std::vector<float> acc = base;
      const void* src = dtype == DType::kFloat32    ? static_cast<const void*>(grad.data())
                        : dtype == DType::kBFloat16 ? grad_bf16.data()
                                                    : grad_half.data();
      ASSERT_TRUE(Accumulate(dtype, src, absl::MakeSpan(acc)).ok());
      for (size_t i = 0; i < n; ++i) {
        const float widened = dtype == DType::kFloat32    ? grad[i]
                              : dtype == DType::kBFloat16 ? BFloat16BitsToFloat(grad_bf16[i])
                                                          : HalfBitsToFloat(grad_half[i]);
        ASSERT_EQ(acc[i], base[i] + widened) << DTypeName(dtype) << " at " << i;
      }
    }
  }
}

TEST(AccumulateKernelTest, RefusesNonFloatSources) {
  std::vector<float> acc(4);
  const int32_t ints[4] = {1, 2, 3, 4};
  absl::Status status = Accumulate(DType::kInt32, ints, absl::MakeSpan(acc));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(acc, std::vector<float>(4, 0.0f));
}

}  // namespace
}  // namespace flatshard::kernels::cpu
