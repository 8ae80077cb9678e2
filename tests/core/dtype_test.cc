#include "core/dtype.h"

#include <gtest/gtest.h>

namespace flatshard {
namespace {

TEST(DTypeTest, NamesRoundTrip) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64,
                      DType::kInt64, DType::kInt32, DType::kInt16, DType::kInt8, DType::kUInt8,
                      DType::kBool}) {
    EXPECT_EQ(*ParseDType(DTypeName(dtype)), dtype);
    EXPECT_EQ(*ParseDType(SafetensorsDTypeName(dtype)), dtype);
  }
}

TEST(DTypeTest, AcceptsTorchSpellings) {
  EXPECT_EQ(*ParseDType("torch.bfloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("float"), DType::kFloat32);
}

TEST(DTypeTest, SizesAndParamDTypes) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_TRUE(IsFloatingParamDType(DType::kFloat16));
  EXPECT_FALSE(IsFloatingParamDType(DType::kFloat64));
  EXPECT_FALSE(IsFloatingParamDType(DType::kInt32));
}

TEST(DTypeTest, UnknownNameIsInvalidArgumentNamingIt) {
  absl::StatusOr<DType> parsed = ParseDType("float8");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("'float8'"), absl::string_view::npos);
}

}  // namespace
}  // namespace flatshard
