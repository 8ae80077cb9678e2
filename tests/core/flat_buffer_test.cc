#include "core/flat_buffer.h"

#include <gtest/gtest.h>

#include <vector>

namespace flatshard {
namespace {

TEST(FlatBufferTest, FlattenRejectsWrongCountsAndSizes) {
  absl::StatusOr<FlatLayout> layout =
      FlatLayout::Create({{"a", {2}, DType::kFloat32}, {"b", {3}, DType::kFloat32}}, 4, 2);
  ASSERT_TRUE(layout.ok());
  const std::vector<float> a = {1, 2};
  const std::vector<float> b = {3, 4, 5};
  const std::vector<float> wrong_b = {3, 4};
  std::vector<float> flat(layout->padded_numel(), -1.0f);

  std::vector<absl::Span<const float>> one = {a};
  EXPECT_EQ(Flatten<float>(*layout, one, absl::MakeSpan(flat)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<absl::Span<const float>> mismatched = {a, wrong_b};
  absl::Status status = Flatten<float>(*layout, mismatched, absl::MakeSpan(flat));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("'b' has 2 elements, expected 3"), absl::string_view::npos);
  EXPECT_EQ(flat, std::vector<float>(flat.size(), -1.0f));  // untouched on error

  std::vector<absl::Span<const float>> good = {a, b};
  std::vector<float> too_small(layout->unpadded_numel() - 1);
  EXPECT_FALSE(Flatten<float>(*layout, good, absl::MakeSpan(too_small)).ok());
  ASSERT_TRUE(Flatten<float>(*layout, good, absl::MakeSpan(flat)).ok());
  EXPECT_EQ(flat, (std::vector<float>{1, 2, 0, 0, 3, 4, 5, 0}));
}

TEST(FlatBufferTest, ExtractShardChecksRankAndSize) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create({{"a", {5}, DType::kFloat32}}, 0, 2);
  ASSERT_TRUE(layout.ok());
  const std::vector<float> flat = {1, 2, 3, 4, 5, 0};
  std::vector<float> shard(3);
  EXPECT_FALSE(ExtractShard<float>(*layout, flat, 2, absl::MakeSpan(shard)).ok());
  std::vector<float> wrong(2);
  EXPECT_FALSE(ExtractShard<float>(*layout, flat, 0, absl::MakeSpan(wrong)).ok());
  ASSERT_TRUE(ExtractShard<float>(*layout, flat, 1, absl::MakeSpan(shard)).ok());
  EXPECT_EQ(shard, (std::vector<float>{4, 5, 0}));
}

}  // namespace
}  // namespace flatshard
