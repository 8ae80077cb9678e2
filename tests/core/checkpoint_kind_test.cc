#include "core/checkpoint_kind.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace flatshard {
namespace {

TEST(CheckpointKindTest, NamesRoundTrip) {
  for (CheckpointKind kind : {CheckpointKind::kFull, CheckpointKind::kSharded, CheckpointKind::kLocal}) {
    absl::StatusOr<CheckpointKind> parsed = ParseCheckpointKind(CheckpointKindName(kind));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_EQ(CheckpointKindName(CheckpointKind::kSharded), "sharded");
}

TEST(CheckpointKindTest, UnknownNamesAreRefusedByName) {
  for (const char* name : {"", "FULL", "shard", "local "}) {
    const absl::Status status = ParseCheckpointKind(name).status();
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << name;
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr(std::string("'") + name + "'"));
  }
}

}  // namespace
}  // namespace flatshard
