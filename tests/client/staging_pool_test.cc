#include "client/staging_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

namespace flatshard::client_internal {
namespace {

// Counts the buffers alive, so that the tests see what the pool frees.
std::atomic<int> live_buffers{0};

absl::StatusOr<StagingBuffer> CountedAllocate(size_t bytes) {
  ++live_buffers;
  return StagingBuffer(std::malloc(bytes), bytes, [](void* data) {
    --live_buffers;
    std::free(data);
  });
}

class StagingPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { live_buffers = 0; }
  void TearDown() override { EXPECT_EQ(live_buffers, 0); }
};

TEST_F(StagingPoolTest, ReturnedBuffersAreReusedSmallestFittingFirst) {
  StagingPool pool(&CountedAllocate, 4);
  absl::StatusOr<StagingBuffer> small = pool.Take(100), large = pool.Take(1000);
  ASSERT_TRUE(small.ok() && large.ok());
  void* const small_data = small->data();
  void* const large_data = large->data();
  pool.Give(*std::move(large));
  pool.Give(*std::move(small));
  EXPECT_EQ(live_buffers, 2);

  absl::StatusOr<StagingBuffer> fits_small = pool.Take(80);
  ASSERT_TRUE(fits_small.ok());
  EXPECT_EQ(fits_small->data(), small_data);
  absl::StatusOr<StagingBuffer> needs_large = pool.Take(500);
  ASSERT_TRUE(needs_large.ok());
  EXPECT_EQ(needs_large->data(), large_data);
  EXPECT_EQ(needs_large->bytes().subspan(0, 500).size(), 500u);
  absl::StatusOr<StagingBuffer> fresh = pool.Take(2000);  // nothing idle fits
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->size(), 2000u);
  EXPECT_EQ(live_buffers, 3);
}

TEST_F(StagingPoolTest, KeepsAtMostMaxIdleDroppingTheSmallest) {
  StagingPool pool(&CountedAllocate, 2);
  std::vector<StagingBuffer> taken;
  for (size_t bytes : {300, 100, 200}) taken.push_back(*pool.Take(bytes));
  for (StagingBuffer& buffer : taken) pool.Give(std::move(buffer));
  EXPECT_EQ(pool.idle(), 2);
  EXPECT_EQ(live_buffers, 2);
  EXPECT_EQ(pool.Take(150)->size(), 200u);  // the 100-byte one was freed
}

TEST_F(StagingPoolTest, AllocationErrorsPassThrough) {
  StagingPool pool(
      [](size_t) -> absl::StatusOr<StagingBuffer> {
        return absl::ResourceExhaustedError("no memory");
      },
      2);
  EXPECT_TRUE(absl::IsResourceExhausted(pool.Take(10).status()));
}

TEST_F(StagingPoolTest, ConcurrentTransfersNeverShareABuffer) {
  StagingPool pool(&CountedAllocate, 3);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        StagingBuffer buffer = *pool.Take(64 + i % 7);
        // Mark it as this thread's; another holder would overwrite the mark.
        buffer.bytes()[0] = static_cast<std::byte>(t);
        std::this_thread::yield();
        EXPECT_EQ(buffer.bytes()[0], static_cast<std::byte>(t));
        pool.Give(std::move(buffer));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(pool.idle(), 3);
}

}  // namespace
}  // namespace flatshard::client_internal
