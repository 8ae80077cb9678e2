// Worked examples of the flat layout, computed by hand from DESIGN.md's rules.
#include "core/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

namespace flatshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ShardParamInfo In(int64_t offset, int64_t numel, int64_t start, int64_t end) {
  return ShardParamInfo{true, offset, numel, start, end};
}
const ShardParamInfo kOut{};

std::vector<TensorSpec> MlpTensors() {
  return {{"fc.weight", {4, 3}, DType::kFloat32},
          {"fc.bias", {4}, DType::kFloat32},
          {"out.weight", {5}, DType::kBFloat16}};
}

TEST(FlatLayoutTest, ThreeShardsNoAlignment) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(MlpTensors(), 0, 3);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->unpadded_numel(), 21);
  EXPECT_EQ(layout->shard_numel(), 7);
  EXPECT_EQ(layout->padded_numel(), 21);
  EXPECT_EQ(layout->tensor_offset(1), 12);
  EXPECT_EQ(layout->tensor_offset(2), 16);
  EXPECT_THAT(layout->shard_param_infos(0), ElementsAre(In(0, 7, 0, 6), kOut, kOut));
  EXPECT_THAT(layout->shard_param_infos(1), ElementsAre(In(0, 5, 7, 11), In(5, 2, 0, 1), kOut));
  EXPECT_THAT(layout->shard_param_infos(2), ElementsAre(kOut, In(0, 2, 2, 3), In(2, 5, 0, 4)));
  for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(layout->shard_padding(rank), 0);

  const ShardMetadata metadata = layout->shard_metadata(1);
  EXPECT_THAT(metadata.fqns, ElementsAre("fc.weight", "fc.bias"));
  EXPECT_THAT(metadata.numels, ElementsAre(12, 4));
  EXPECT_EQ(metadata.shapes[0], (std::vector<int64_t>{4, 3}));
  EXPECT_THAT(metadata.offsets, ElementsAre(std::make_pair(7, 11), std::make_pair(0, 1)));
}

// a(3) | pad | b(2x2) | c(0) | d() | pad pad pad | e(5); U = 17.
std::vector<TensorSpec> AlignedTensors() {
  return {{"a", {3}, DType::kFloat32},
          {"b", {2, 2}, DType::kFloat32},
          {"c", {0, 7}, DType::kFloat16},
          {"d", {}, DType::kFloat32},
          {"e", {5}, DType::kFloat32}};
}

TEST(FlatLayoutTest, AlignFourFourShards) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(AlignedTensors(), 4, 4);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->unpadded_numel(), 17);
  EXPECT_EQ(layout->shard_numel(), 5);
  EXPECT_EQ(layout->padded_numel(), 20);
  EXPECT_THAT(std::vector<int64_t>({layout->tensor_offset(0), layout->tensor_offset(1),
                                    layout->tensor_offset(2), layout->tensor_offset(3),
                                    layout->tensor_offset(4)}),
              ElementsAre(0, 4, 8, 8, 12));
  EXPECT_EQ(layout->tensor_numel(2), 0);
  EXPECT_EQ(layout->tensor_numel(3), 1);
  EXPECT_THAT(layout->shard_param_infos(0), ElementsAre(In(0, 3, 0, 2), In(4, 1, 0, 0), kOut, kOut, kOut));
  EXPECT_THAT(layout->shard_param_infos(1), ElementsAre(kOut, In(0, 3, 1, 3), kOut, In(3, 1, 0, 0), kOut));
  EXPECT_THAT(layout->shard_param_infos(2), ElementsAre(kOut, kOut, kOut, kOut, In(2, 3, 0, 2)));
  EXPECT_THAT(layout->shard_param_infos(3), ElementsAre(kOut, kOut, kOut, kOut, In(0, 2, 3, 4)));
  EXPECT_EQ(layout->shard_start(3), 15);
  EXPECT_EQ(layout->shard_end(3), 17);
  EXPECT_EQ(layout->shard_padding(3), 3);
}

TEST(FlatLayoutTest, SameTensorsNoAlignmentSevenShards) {
  // a 0..2, b 3..6, c at 7 (empty), d 7, e 8..12; U = 13, S = 2, N*S = 14.
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(AlignedTensors(), 0, 7);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->unpadded_numel(), 13);
  EXPECT_EQ(layout->shard_numel(), 2);
  EXPECT_EQ(layout->padded_numel(), 14);
  EXPECT_THAT(layout->shard_param_infos(1), ElementsAre(In(0, 1, 2, 2), In(1, 1, 0, 0), kOut, kOut, kOut));
  EXPECT_THAT(layout->shard_param_infos(3), ElementsAre(kOut, In(0, 1, 3, 3), kOut, In(1, 1, 0, 0), kOut));
  EXPECT_THAT(layout->shard_param_infos(6), ElementsAre(kOut, kOut, kOut, kOut, In(0, 1, 4, 4)));
  EXPECT_EQ(layout->shard_padding(6), 1);
}

TEST(FlatLayoutTest, SingleShardHoldsEverything) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(MlpTensors(), 0, 1);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->shard_numel(), 21);
  EXPECT_THAT(layout->shard_param_infos(0),
              ElementsAre(In(0, 12, 0, 11), In(12, 4, 0, 3), In(16, 5, 0, 4)));
}

TEST(FlatLayoutTest, MoreShardsThanElements) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create({{"tiny", {2}, DType::kFloat32}}, 0, 4);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->shard_numel(), 1);
  EXPECT_EQ(layout->padded_numel(), 4);
  EXPECT_THAT(layout->shard_param_infos(1), ElementsAre(In(0, 1, 1, 1)));
  for (int rank : {2, 3}) {
    EXPECT_EQ(layout->shard_start(rank), rank);
    EXPECT_EQ(layout->shard_end(rank), rank);
    EXPECT_EQ(layout->shard_padding(rank), 1);
    EXPECT_THAT(layout->shard_param_infos(rank), ElementsAre(kOut));
    EXPECT_TRUE(layout->shard_metadata(rank).fqns.empty());
  }
}

TEST(FlatLayoutTest, AllTensorsEmpty) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create({{"none", {0}, DType::kFloat32}}, 0, 3);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->unpadded_numel(), 0);
  EXPECT_EQ(layout->shard_numel(), 0);
  EXPECT_EQ(layout->shard_padding(2), 0);
  EXPECT_THAT(layout->shard_param_infos(0), ElementsAre(kOut));
}

TEST(FlatLayoutTest, MapRangeSkipsPaddingAndEmptyTensors) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(AlignedTensors(), 4, 4);
  ASSERT_TRUE(layout.ok());
  // [2, 14): a[2], pad 3, b[0..4), c empty, d[0], pad 9..11, e[0..2).
  EXPECT_THAT(layout->MapRange(2, 14),
              ElementsAre(TensorPiece{0, 2, 1, 2}, TensorPiece{1, 0, 4, 4},
                          TensorPiece{3, 0, 1, 8}, TensorPiece{4, 0, 2, 12}));
  EXPECT_THAT(layout->MapRange(17, 20), ElementsAre());  // shard padding only
  EXPECT_THAT(layout->MapRange(9, 12), ElementsAre());   // alignment padding only
  EXPECT_EQ(layout->FlatIndex(4, 3), 15);
}

TEST(FlatLayoutTest, FindTensor) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(MlpTensors(), 0, 2);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->FindTensor("fc.bias"), 1);
  EXPECT_EQ(layout->FindTensor("missing"), std::nullopt);
}

void ExpectInvalid(std::vector<TensorSpec> tensors, int64_t align, int shards,
                   const std::string& message_part) {
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(std::move(tensors), align, shards);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr(message_part));
}

TEST(FlatLayoutTest, RejectsInvalidSpecsNamingTheField) {
  ExpectInvalid({}, 0, 1, "tensors: the list is empty");
  ExpectInvalid({{"", {1}, DType::kFloat32}}, 0, 1, "tensors[0]: empty name");
  ExpectInvalid({{"w", {1}, DType::kFloat32}, {"w", {2}, DType::kFloat32}}, 0, 1,
                "tensors[1] 'w': duplicate name");
  ExpectInvalid({{"w", {3, -1}, DType::kFloat32}}, 0, 1,
                "tensors[0] 'w': dimension 1 is -1");
  ExpectInvalid({{"w", {int64_t{1} << 40, int64_t{1} << 40}, DType::kFloat32}}, 0, 1,
                "tensors[0] 'w': numel overflows int64");
  ExpectInvalid({{"a", {int64_t{1} << 62}, DType::kFloat32},
                 {"b", {int64_t{1} << 62}, DType::kFloat32}},
                0, 1, "overflows int64");
  ExpectInvalid({{"w", {2}, DType::kInt64}}, 0, 1, "dtype int64 cannot be a flat parameter");
  ExpectInvalid({{"w", {2}, DType::kFloat32}}, 0, 0, "servers: 0, must be >= 1");
  ExpectInvalid({{"w", {2}, DType::kFloat32}}, -4, 1, "align: -4");
}

TEST(FlatLayoutTest, PaddedSizeMustFitInt64) {
  // U = INT64_MAX fits, but N*S = 2 * 2^62 does not.
  ExpectInvalid({{"w", {std::numeric_limits<int64_t>::max()}, DType::kFloat32}}, 0, 2,
                "padded flat parameter overflows int64");
  EXPECT_TRUE(FlatLayout::Create({{"w", {int64_t{1} << 62}, DType::kFloat32}}, 0, 3).ok());
}

}  // namespace
}  // namespace flatshard
