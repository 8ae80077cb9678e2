// DirectFileWriter: whatever the offsets, the file ends up holding exactly the bytes
// written, with two writers sharing the partial pages at their boundaries (as the servers
// of a FULL checkpoint do) and with runs that jump around.
#include "core/direct_io.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <vector>

#include "core/file.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

std::string Path(const std::string& name) { return testing::ScratchPath("direct-io-" + name); }

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> bytes(n);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

std::vector<std::byte> ReadAll(const std::string& path) {
  auto file = File::Open(path, File::Mode::kRead);
  EXPECT_TRUE(file.ok());
  std::vector<std::byte> bytes(*file->Size());
  EXPECT_TRUE(file->ReadAt(0, absl::MakeSpan(bytes)).ok());
  return bytes;
}

TEST(DirectFileWriterTest, TwoWritersShareBoundaryPagesOfOneFile) {
  const std::string path = Path("shared");
  std::filesystem::remove(path);
  // 40 MiB + 1234 bytes: several 16 MiB blocks; the split point and the writes' sizes
  // fall inside pages.
  const size_t size = (size_t{40} << 20) + 1234, split = (size_t{17} << 20) + 777;
  const std::vector<std::byte> expected = RandomBytes(size, 1);
  auto a = DirectFileWriter::Open(path, size, false);
  auto b = DirectFileWriter::Open(path, size, false);
  ASSERT_TRUE(a.ok() && b.ok());
  // Interleaved: a writes [0, split) and b [split, size), in slices of odd sizes.
  size_t at_a = 0, at_b = split;
  const size_t slice = (size_t{3} << 20) + 5;
  while (at_a < split || at_b < size) {
    if (at_a < split) {
      const size_t n = std::min(slice, split - at_a);
      ASSERT_TRUE(a->Write(at_a, absl::MakeConstSpan(expected).subspan(at_a, n)).ok());
      at_a += n;
    }
    if (at_b < size) {
      const size_t n = std::min(slice, size - at_b);
      ASSERT_TRUE(b->Write(at_b, absl::MakeConstSpan(expected).subspan(at_b, n)).ok());
      at_b += n;
    }
  }
  ASSERT_TRUE(a->Close().ok());
  ASSERT_TRUE(b->Close().ok());
  EXPECT_TRUE(ReadAll(path) == expected);
}

TEST(DirectFileWriterTest, RunsInAnyOrderAndTruncation) {
  const std::string path = Path("runs");
  {  // old, longer contents are dropped by a truncating open
    auto old = DirectFileWriter::Open(path, 1 << 20, true);
    ASSERT_TRUE(old.ok());
    const std::vector<std::byte> junk = RandomBytes(1 << 20, 2);
    ASSERT_TRUE(old->Write(0, junk).ok());
    ASSERT_TRUE(old->Close().ok());
  }
  const size_t size = 300'000;
  const std::vector<std::byte> expected = RandomBytes(size, 3);
  auto writer = DirectFileWriter::Open(path, size, true);
  ASSERT_TRUE(writer.ok());
  // Back to front in uneven pieces, then one byte in the middle rewritten last.
  for (size_t end = size; end > 0;) {
    const size_t begin = end > 70'001 ? end - 70'001 : 0;
    ASSERT_TRUE(writer->Write(begin, absl::MakeConstSpan(expected).subspan(begin, end - begin)).ok());
    end = begin;
  }
  ASSERT_TRUE(writer->Write(150'000, absl::MakeConstSpan(expected).subspan(150'000, 1)).ok());
  ASSERT_TRUE(writer->Close().ok());
  EXPECT_TRUE(ReadAll(path) == expected);
}

}  // namespace
}  // namespace flatshard
