// FileExtent helpers: XXH3 as the server computes it (the run-time dispatched vector
// code), at once or piece by piece, equals an independent scalar build of the reference
// implementation, and the specification's value; tiling refuses gaps, overlaps, short coverage and lengths that
// wrap; the manifest's JSON form round-trips and refuses malformed entries.
#include "server/file_extents.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

// The reference: xxHash's own code, inlined into this file (its symbols renamed) and
// forced to the portable scalar path, whatever the CPU has.
#define XXH_INLINE_ALL
#define XXH_VECTOR 0  // XXH_SCALAR
#include <xxhash.h>

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

TEST(FileExtentsTest, Xxh3EqualsTheScalarReferenceAtEveryLengthAndAlignment) {
  // The specification's test vector for empty input.
  EXPECT_EQ(Xxh3({}), 0x2D06800538D394C2ull);
  std::mt19937_64 rng(7);
  std::vector<std::byte> bytes((size_t{3} << 20) + 64);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  // Every length up to 4 KiB covers each of XXH3's size classes (0-16, 17-128, 129-240,
  // then stripes and blocks); then lengths past several 1 KiB blocks, at odd offsets.
  for (size_t length = 0; length <= 4096; ++length) {
    ASSERT_EQ(Xxh3(absl::MakeConstSpan(bytes.data(), length)), XXH3_64bits(bytes.data(), length))
        << "length " << length;
  }
  for (size_t length : {size_t{65537}, size_t{1} << 20, (size_t{3} << 20) + 13}) {
    for (size_t offset : {0, 1, 7, 33}) {
      ASSERT_EQ(Xxh3(absl::MakeConstSpan(bytes.data() + offset, length)), XXH3_64bits(bytes.data() + offset, length))
          << "length " << length << " at offset " << offset;
    }
  }
  // A one-bit change anywhere changes the sum.
  const uint64_t before = Xxh3(bytes);
  bytes[bytes.size() / 2] ^= std::byte{1};
  EXPECT_NE(Xxh3(bytes), before);
}

// Pieces of random lengths (0 to 3000 bytes, across XXH3's size classes and its internal
// 256-byte buffer) hashed as they come equal the scalar reference over their concatenation
// after every piece; Reset starts over.
TEST(FileExtentsTest, AStreamOfPiecesHashesAsTheirConcatenation) {
  std::mt19937_64 rng(11);
  std::vector<std::byte> bytes(size_t{1} << 20);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  Xxh3Stream stream;
  EXPECT_EQ(stream.Digest(), XXH3_64bits(nullptr, 0));
  for (int round = 0; round < 3; ++round) {
    stream.Reset();
    size_t at = static_cast<size_t>(rng() % 64);
    const size_t start = at;
    while (true) {
      const size_t length = static_cast<size_t>(rng() % 3001);
      if (at + length > bytes.size()) break;
      stream.Update(absl::MakeConstSpan(bytes.data() + at, length));
      at += length;
      ASSERT_EQ(stream.Digest(), XXH3_64bits(bytes.data() + start, at - start)) << "round " << round << ", " << at;
    }
  }
}

TEST(FileExtentsTest, TilingRefusesGapsOverlapsAndShortCoverage) {
  std::vector<FileExtent> gap = {{10, 5, 0}, {0, 8, 0}};
  absl::Status status = SortAndCheckTiling(gap, 15, "file");
  EXPECT_THAT(std::string(status.message()), HasSubstr("bytes [8, 10) were written by no server"));
  std::vector<FileExtent> overlap = {{0, 8, 0}, {6, 9, 0}};
  status = SortAndCheckTiling(overlap, 15, "file");
  EXPECT_THAT(std::string(status.message()), HasSubstr("bytes [6, 8) were written twice"));
  std::vector<FileExtent> short_cover = {{0, 8, 0}};
  EXPECT_EQ(SortAndCheckTiling(short_cover, 15, "file").code(), absl::StatusCode::kFailedPrecondition);
  // Lengths that wrap past 2^64 back to the file's size.
  std::vector<FileExtent> wrap = {{0, ~uint64_t{0}, 0}, {~uint64_t{0}, 16, 0}};
  status = SortAndCheckTiling(wrap, 15, "file");
  EXPECT_THAT(std::string(status.message()), HasSubstr("ends past the end of the file (15 bytes)"));
  std::vector<FileExtent> past_end = {{0, 8, 0}, {8, 9, 0}};
  EXPECT_EQ(SortAndCheckTiling(past_end, 15, "file").code(), absl::StatusCode::kFailedPrecondition);
  std::vector<FileExtent> exact = {{8, 7, 1}, {0, 8, 2}};
  EXPECT_TRUE(SortAndCheckTiling(exact, 15, "file").ok());
  EXPECT_EQ(exact[0].offset, 0u);

  absl::StatusOr<std::vector<FileExtent>> back = ExtentsFromJson(ExtentsToJson(exact), "file");
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[1].xxh3, 1u);
  EXPECT_EQ(ExtentsFromJson(nlohmann::json::parse(R"([[0, 4, "zz"]])"), "file").status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace flatshard::server
