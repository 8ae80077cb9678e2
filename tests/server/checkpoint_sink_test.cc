// DirectorySink refuses what a peer's WriteCheckpointPart stream may carry and a save never
// writes: names outside one path component, sizes no file can have, writes past a file's
// size, writes and closes of a file that is not open. Each is InvalidArgument naming the
// file, and nothing is created for a refused name or size.
#include "server/checkpoint_sink.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "tests/scratch_dir.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

void ExpectRefused(const absl::Status& status, const std::string& message) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(message));
}

TEST(CheckpointSinkTest, BadNamesAndSizesAreRefusedBeforeAnyFileExists) {
  const testing::ScratchDir dir("sink-names");
  DirectorySink sink(dir.path());
  for (const std::string& name : {std::string(""), std::string(".hidden"), std::string("../escape"),
                                  std::string("a/b"), std::string(129, 'x'), std::string("nul\0x", 5)}) {
    ExpectRefused(sink.Open(name, 16, true), "use 1-128 characters of [A-Za-z0-9._-]");
  }
  ExpectRefused(sink.Open("huge", uint64_t{1} << 63, true), "checkpoint file 'huge': 9223372036854775808 bytes");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  EXPECT_TRUE(sink.Open(std::string(128, 'x'), 16, true).ok());
}

TEST(CheckpointSinkTest, WritesOutsideAnOpenFileAreRefusedAndTheFileStaysWhole) {
  const testing::ScratchDir dir("sink-writes");
  DirectorySink sink(dir.path());
  const std::vector<std::byte> bytes(8, std::byte{7});
  ExpectRefused(sink.Write("f", 0, bytes), "checkpoint file 'f' written before it was opened");
  ExpectRefused(sink.Close("f"), "checkpoint file 'f' closed before it was opened");
  ASSERT_TRUE(sink.Open("f", 12, true).ok());
  ExpectRefused(sink.Write("f", 8, bytes), "8 bytes at offset 8 run past its 12 bytes");
  ExpectRefused(sink.Write("f", std::numeric_limits<uint64_t>::max(), bytes), "run past its 12 bytes");
  ExpectRefused(sink.Write("f", 13, {}), "0 bytes at offset 13");
  ASSERT_TRUE(sink.Write("f", 4, bytes).ok());
  ASSERT_TRUE(sink.Close("f").ok());
  EXPECT_EQ(std::filesystem::file_size(dir.path() + "/f"), 12u);
  ASSERT_EQ(sink.extents().at("f").size(), 1u);
  EXPECT_EQ(sink.extents().at("f")[0].offset, 4u);
}

}  // namespace
}  // namespace flatshard::server
