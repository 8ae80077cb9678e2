// LinkPool with fake links: one transfer per link at a time, reuse of healthy links,
// failed and dropped links replaced, a device change, the idle bound, a stop reaching a
// link being opened.
#include "client/link_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <stop_token>
#include <thread>
#include <vector>

namespace flatshard::client_internal {
namespace {

struct FakeLink {
  explicit FakeLink(int device) : device_(device) {}
  int device() const { return device_; }
  bool failed() const { return failed_; }
  int device_;
  bool failed_ = false;
  std::atomic<int> users{0};  // leases holding it now
};

class LinkPoolTest : public ::testing::Test {
 protected:
  LinkPool<FakeLink> MakePool(int max_idle) {
    return LinkPool<FakeLink>(
        max_idle, [this](int device, const std::stop_token& stop) -> absl::StatusOr<std::shared_ptr<FakeLink>> {
          if (refuse_) return absl::UnavailableError("the server refused the channel");
          // A join whose server never comes: it ends at the stop, or at its own deadline
          // when no stop reaches it.
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (hang_ && !stop.stop_requested()) {
            if (std::chrono::steady_clock::now() > deadline) return absl::DeadlineExceededError("no stop came");
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          if (stop.stop_requested()) return absl::CancelledError("the join was stopped");
          ++opened_;
          return std::make_shared<FakeLink>(device);
        });
  }
  std::atomic<int> opened_{0};
  bool refuse_ = false;
  std::atomic<bool> hang_{false};
};

TEST_F(LinkPoolTest, TransfersAtOnceGetTheirOwnLinksWhichAreThenReused) {
  auto pool = MakePool(2);
  FakeLink* first = nullptr;
  FakeLink* second = nullptr;
  {
    auto a = pool.Acquire(0);
    auto b = pool.Acquire(0);
    ASSERT_TRUE(a.ok() && b.ok());
    first = &**a;
    second = &**b;
    EXPECT_NE(first, second);
    EXPECT_EQ(opened_, 2);
    EXPECT_EQ(pool.idle_links(), 0);
  }
  EXPECT_EQ(pool.idle_links(), 2);
  auto again = pool.Acquire(0);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(&**again == first || &**again == second);
  EXPECT_EQ(opened_, 2) << "an idle healthy link is reused";
}

TEST_F(LinkPoolTest, FailedAndDroppedLinksAreReplaced) {
  auto pool = MakePool(2);
  {
    auto lease = pool.Acquire(0);
    ASSERT_TRUE(lease.ok());
    (*lease)->failed_ = true;  // its communicator was aborted
  }
  EXPECT_EQ(pool.idle_links(), 0);
  {
    auto lease = pool.Acquire(0);
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(opened_, 2);
    lease->Drop();  // the server closed its channel
  }
  EXPECT_EQ(pool.idle_links(), 0);
  ASSERT_TRUE(pool.Acquire(0).ok());
  EXPECT_EQ(opened_, 3);
}

TEST_F(LinkPoolTest, AnotherDeviceGetsANewLinkAndTheOldOnesClose) {
  auto pool = MakePool(2);
  { ASSERT_TRUE(pool.Acquire(0).ok()); }
  EXPECT_EQ(pool.idle_links(), 1);
  auto lease = pool.Acquire(1);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ((*lease)->device(), 1);
  EXPECT_EQ(opened_, 2);
  EXPECT_EQ(pool.idle_links(), 0) << "the device 0 link was closed";
}

TEST_F(LinkPoolTest, IdleLinksBeyondTheBoundCloseAndOpenErrorsPassThrough) {
  auto pool = MakePool(2);
  {
    std::vector<LinkPool<FakeLink>::Lease> leases;
    for (int i = 0; i < 3; ++i) leases.push_back(*pool.Acquire(0));
  }
  EXPECT_EQ(pool.idle_links(), 2);
  {
    auto a = pool.Acquire(0), b = pool.Acquire(0);
    refuse_ = true;
    auto c = pool.Acquire(0);
    ASSERT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(c.status().message(), "the server refused the channel");
  }
  EXPECT_EQ(pool.idle_links(), 2);
}

TEST_F(LinkPoolTest, AStopEndsALinkBeingOpenedAndTheNextOpensAfresh) {
  auto pool = MakePool(2);
  hang_ = true;
  std::stop_source stop;
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    stop.request_stop();
  });
  auto stopped = pool.Acquire(0, stop.get_token());
  stopper.join();
  ASSERT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
  EXPECT_EQ(stopped.status().message(), "the join was stopped");
  EXPECT_EQ(pool.idle_links(), 0);
  hang_ = false;
  auto opened = pool.Acquire(0, std::stop_source().get_token());
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened_, 1);
}

TEST_F(LinkPoolTest, NoLinkIsLentToTwoTransfersAtOnce) {
  auto pool = MakePool(3);
  std::atomic<bool> shared{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        auto lease = pool.Acquire(0);
        ASSERT_TRUE(lease.ok());
        if ((*lease)->users.fetch_add(1) != 0) shared = true;
        std::this_thread::yield();
        (*lease)->users.fetch_sub(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_FALSE(shared);
  EXPECT_LE(opened_, 3) << "never more links than transfers at once";
}

}  // namespace
}  // namespace flatshard::client_internal
