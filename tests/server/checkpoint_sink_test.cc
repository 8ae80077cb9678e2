// DirectorySink refuses what a peer's WriteCheckpointPart stream may carry and a save never
// writes: names outside one path component, sizes no file can have, writes past a file's
// size, writes and closes of a file that is not open. Each is InvalidArgument naming the
// file, and nothing is created for a refused name or size. The extents it records join
// contiguous writes up to their bound, each with the checksum of the bytes on disk.
#include "server/checkpoint_sink.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <limits>
#include <string>
#include <utility>
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

// Each extent DirectorySink reports matches the bytes on disk in that range (XXH3 of the
// file read back); writes that continue the last extent join it up to kMaxExtentBytes; a
// gap, a write elsewhere or a file opened again starts a new one; the extents tile what
// was written.
TEST(CheckpointSinkTest, ContiguousWritesJoinOneExtentUpToItsBound) {
  const testing::ScratchDir dir("sink-extents");
  constexpr uint64_t kMax = DirectorySink::kMaxExtentBytes;
  std::mt19937_64 rng(5);
  std::vector<std::byte> bytes(3 * kMax);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  auto piece = [&](uint64_t at, uint64_t length) { return absl::MakeConstSpan(bytes.data() + at, length); };

  DirectorySink sink(dir.path());
  ASSERT_TRUE(sink.Open("f", bytes.size(), true).ok());
  for (uint64_t at = 0; at < 1000; at += 10) ASSERT_TRUE(sink.Write("f", at, piece(at, 10)).ok());  // one extent
  ASSERT_TRUE(sink.Write("f", 2000, piece(2000, 100)).ok());                                    // a gap
  ASSERT_TRUE(sink.Write("f", 1000, piece(1000, 1000)).ok());                                   // back, before it
  const uint64_t big = kMax / 2 + 1;  // two of them overrun the bound: the second starts anew
  for (uint64_t at = 2100; at + big <= 2100 + 3 * big; at += big) ASSERT_TRUE(sink.Write("f", at, piece(at, big)).ok());
  const uint64_t end = 2100 + 3 * big;
  ASSERT_TRUE(sink.Close("f").ok());
  // Opened again (another writer's range, say): a write right after the last extent is
  // not joined to it, whose bytes this Open never saw.
  ASSERT_TRUE(sink.Open("f", bytes.size(), false).ok());
  ASSERT_TRUE(sink.Write("f", end, piece(end, 7)).ok());
  ASSERT_TRUE(sink.Close("f").ok());

  const std::vector<std::pair<uint64_t, uint64_t>> expected = {
      {0, 1000}, {2000, 100}, {1000, 1000}, {2100, big}, {2100 + big, big}, {2100 + 2 * big, big}, {end, 7}};
  const std::vector<FileExtent>& extents = sink.extents().at("f");
  ASSERT_EQ(extents.size(), expected.size());
  std::ifstream in(dir.path() + "/f", std::ios::binary);
  std::vector<char> on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(on_disk.size(), bytes.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(extents[i].offset, expected[i].first) << i;
    EXPECT_EQ(extents[i].length, expected[i].second) << i;
    EXPECT_LE(extents[i].length, kMax);
    const auto disk = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(on_disk.data()) + extents[i].offset,
                                          extents[i].length);
    EXPECT_EQ(extents[i].xxh3, Xxh3(disk)) << i;
  }
  std::vector<FileExtent> sorted = extents;
  EXPECT_TRUE(SortAndCheckTiling(sorted, end + 7, "f").ok());
}

}  // namespace
}  // namespace flatshard::server
