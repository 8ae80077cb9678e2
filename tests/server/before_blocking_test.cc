#include "server/before_blocking.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace flatshard::server {
namespace {

// The hook runs before a wait whose condition does not hold yet, with the wait's mutex
// released (another thread can take it meanwhile), and not before one that need not wait.
TEST(BeforeBlockingTest, TheHookRunsWithTheMutexReleasedBeforeAWaitThatBlocks) {
  absl::Mutex mu;
  bool ready = false;
  std::vector<bool> mutex_free;  // per run of the hook
  const BlockingHook hook([&] {
    std::thread other([&] {
      mutex_free.push_back(mu.TryLock());
      if (mutex_free.back()) mu.Unlock();
    });
    other.join();
  });
  std::thread readier([&] {
    absl::SleepFor(absl::Milliseconds(50));
    absl::MutexLock lock(&mu);
    ready = true;
  });
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(AwaitBlocking(mu, absl::Condition(&ready)));
    EXPECT_EQ(mutex_free, std::vector<bool>{true});
    EXPECT_TRUE(AwaitBlocking(mu, absl::Condition(&ready), absl::Now()));  // ready: no wait, no hook
    EXPECT_EQ(mutex_free.size(), 1u);
  }
  readier.join();
  BeforeBlocking();
  EXPECT_EQ(mutex_free.size(), 2u);
}

TEST(BeforeBlockingTest, HooksNestAndBelongToTheirThread) {
  std::vector<int> ran;
  BeforeBlocking();  // none: nothing runs
  {
    const BlockingHook outer([&] { ran.push_back(1); });
    {
      const BlockingHook inner([&] { ran.push_back(2); });
      BeforeBlocking();
      std::thread([] { BeforeBlocking(); }).join();  // another thread has none
    }
    BeforeBlocking();
  }
  BeforeBlocking();
  EXPECT_EQ(ran, (std::vector<int>{2, 1}));

  absl::Mutex mu;
  bool never = false;
  absl::MutexLock lock(&mu);
  EXPECT_FALSE(AwaitBlocking(mu, absl::Condition(&never), absl::Now() + absl::Milliseconds(10)));
}

}  // namespace
}  // namespace flatshard::server
