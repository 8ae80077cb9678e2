// HostSlab: small buffers are aligned, disjoint, zero-filled pieces of shared blocks that
// outlive the slab and each other's release; large ones are allocated on their own. Run under ASan
// (FLATSHARD_SANITIZE=address), the writes after the slab and most buffers are gone
// would be reported if a block were freed early, and a block never freed as a leak.
#include "server/host_slab.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace flatshard::server {
namespace {

uintptr_t Address(const ShardBuffer& buffer) { return reinterpret_cast<uintptr_t>(buffer.data()); }

TEST(HostSlabTest, SmallBuffersAreAlignedDisjointPiecesThatKeepTheirBlock) {
  std::vector<ShardBuffer> buffers;
  {
    HostSlab slab;
    EXPECT_EQ(slab.Allocate(0, "nothing")->data(), nullptr);
    // 4000 buffers of 1-9000 bytes: several blocks.
    size_t total = 0;
    for (size_t i = 0; i < 4000; ++i) {
      const size_t bytes = 1 + (i * 7919) % 9000;
      absl::StatusOr<ShardBuffer> buffer = slab.Allocate(bytes, "test");
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      ASSERT_EQ(buffer->size(), bytes);
      ASSERT_EQ(Address(*buffer) % HostSlab::kPieceAlign, 0u) << i;
      std::memset(buffer->data(), static_cast<int>(i % 251), bytes);
      total += bytes;
      buffers.push_back(*std::move(buffer));
    }
    ASSERT_GT(total, 2 * HostSlab::kBlockBytes);
  }
  // Disjoint: every buffer still holds its own fill once all are written.
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto* bytes = static_cast<const unsigned char*>(buffers[i].data());
    for (size_t k = 0; k < buffers[i].size(); ++k) ASSERT_EQ(bytes[k], i % 251) << i << " " << k;
  }
  // Releasing the first half of the buffers (whole blocks among them) keeps the rest of
  // their blocks usable.
  std::optional<ShardBuffer> last = std::move(buffers.back());
  buffers.pop_back();
  buffers.erase(buffers.begin(), buffers.begin() + static_cast<std::ptrdiff_t>(buffers.size() / 2));
  for (ShardBuffer& buffer : buffers) std::memset(buffer.data(), 0xab, buffer.size());
  std::memset(last->data(), 0xcd, last->size());
  buffers.clear();
  last.reset();
}

bool AllZero(const ShardBuffer& buffer) {
  const auto* bytes = static_cast<const unsigned char*>(buffer.data());
  return std::all_of(bytes, bytes + buffer.size(), [](unsigned char b) { return b == 0; });
}

// Groups take their pieces as zeroed memory (Group::Create): so must every piece be, also
// where a block that was written and released lay before (freed heap memory would come
// back dirty).
TEST(HostSlabTest, SmallBuffersAreZeroEvenWhereWrittenBlocksWereReleased) {
  for (int round = 0; round < 3; ++round) {
    HostSlab slab;
    std::vector<ShardBuffer> buffers;
    for (size_t i = 0; i < 600; ++i) {  // 600 x 8 KiB: two blocks
      absl::StatusOr<ShardBuffer> buffer = slab.Allocate(8192 + 4 * (i % 3), "test");
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      ASSERT_TRUE(HostSlab::Carves(buffer->size()));
      ASSERT_TRUE(AllZero(*buffer)) << "round " << round << " buffer " << i;
      std::memset(buffer->data(), 0x5a, buffer->size());
      buffers.push_back(*std::move(buffer));
    }
  }
  EXPECT_FALSE(HostSlab::Carves(0));
  EXPECT_FALSE(HostSlab::Carves(HostSlab::kMaxPieceBytes));
}

// A slab maps what it carves and at most about as much again: blocks start at
// kFirstBlockBytes and double up to kBlockBytes, and a first piece larger than the first
// block gets a block of its size.
TEST(HostSlabTest, BlocksGrowFromSmallWithWhatIsCarved) {
  HostSlab slab;
  EXPECT_EQ(slab.mapped_bytes(), 0u);
  std::vector<ShardBuffer> buffers;
  buffers.push_back(*slab.Allocate(100, "tiny"));
  EXPECT_EQ(slab.mapped_bytes(), HostSlab::kFirstBlockBytes);
  size_t carved = 128;
  while (carved < 3 * HostSlab::kBlockBytes) {
    absl::StatusOr<ShardBuffer> buffer = slab.Allocate(8192, "test");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffers.push_back(*std::move(buffer));
    carved += 8192;
    ASSERT_LE(slab.mapped_bytes(), 2 * carved + HostSlab::kFirstBlockBytes) << carved;
  }
  EXPECT_GE(slab.mapped_bytes(), carved);

  HostSlab first_large;
  absl::StatusOr<ShardBuffer> large = first_large.Allocate(HostSlab::kMaxPieceBytes - 64, "large");
  ASSERT_TRUE(large.ok()) << large.status();
  ASSERT_TRUE(HostSlab::Carves(large->size()));
  EXPECT_TRUE(AllZero(*large));
  EXPECT_EQ(first_large.mapped_bytes(), HostSlab::kMaxPieceBytes - 64);
  std::memset(large->data(), 1, large->size());
}

TEST(HostSlabTest, LargeBuffersAreTheirOwn) {
  HostSlab slab;
  absl::StatusOr<ShardBuffer> small = slab.Allocate(4096, "small");
  absl::StatusOr<ShardBuffer> large = slab.Allocate(HostSlab::kMaxPieceBytes, "large");
  absl::StatusOr<ShardBuffer> next = slab.Allocate(4096, "small");
  ASSERT_TRUE(small.ok() && large.ok() && next.ok());
  // The large one is not carved from the block: the next small piece follows the first.
  EXPECT_EQ(Address(*next), Address(*small) + 4096);
  EXPECT_TRUE(Address(*large) + large->size() <= Address(*small) || Address(*large) >= Address(*next) + 4096);
  std::memset(large->data(), 1, large->size());
}

}  // namespace
}  // namespace flatshard::server
