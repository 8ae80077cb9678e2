#include "flatshard/await.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"

namespace flatshard {
namespace {

TEST(AwaitTest, ReturnsWhatTheFutureHolds) {
  std::promise<absl::StatusOr<int64_t>> ready;
  ready.set_value(7);
  EXPECT_EQ(Await(ready.get_future()).value(), 7);

  std::promise<absl::Status> failed;
  failed.set_value(absl::AbortedError("torn"));
  EXPECT_EQ(Await(failed.get_future()), absl::AbortedError("torn"));
}

// Set by another thread after `delay`, as a data channel's thread finishes a transfer.
std::future<int> SetLater(std::thread& setter, absl::Duration delay, int value) {
  auto promise = std::make_shared<std::promise<int>>();
  std::future<int> future = promise->get_future();
  setter = std::thread([promise, delay, value] {
    absl::SleepFor(delay);
    promise->set_value(value);
  });
  return future;
}

TEST(AwaitTest, AResultThatComesWithinTheWindowEndsThePolling) {
  std::thread setter;
  std::future<int> future = SetLater(setter, absl::Milliseconds(20), 3);
  const absl::Time start = absl::Now();
  EXPECT_EQ(Await(future, absl::Seconds(30)), 3);
  // Polling stopped when the result came, not at the end of its 30 s window.
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  setter.join();
}

TEST(AwaitTest, AResultThatComesAfterTheWindowIsWaitedFor) {
  for (absl::Duration spin : {absl::ZeroDuration(), absl::Microseconds(50)}) {
    std::thread setter;
    std::future<int> future = SetLater(setter, absl::Milliseconds(30), 5);
    EXPECT_EQ(Await(future, spin), 5);
    EXPECT_FALSE(future.valid());  // taken, as get() takes it
    setter.join();
  }
}

TEST(AwaitTest, ADeferredFutureRunsAtOnceWithoutPolling) {
  std::future<int> deferred = std::async(std::launch::deferred, [] { return 11; });
  const absl::Time start = absl::Now();
  EXPECT_EQ(Await(deferred, absl::Seconds(30)), 11);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(AwaitTest, AwaitForSaysWhetherTheResultCameWithinItsTime) {
  std::thread setter;
  std::future<int> future = SetLater(setter, absl::Milliseconds(300), 9);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(AwaitFor(future, absl::Milliseconds(20)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));  // it waited its time
  EXPECT_TRUE(future.valid());                             // the result is not taken
  EXPECT_TRUE(AwaitFor(future, absl::Seconds(30), absl::ZeroDuration()));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // ended by the result, not the 30 s
  EXPECT_EQ(future.get(), 9);
  setter.join();

  const std::shared_future<int> deferred = std::async(std::launch::deferred, [] { return 4; }).share();
  EXPECT_TRUE(AwaitFor(deferred, absl::Seconds(30)));  // get() does not wait for it
  EXPECT_EQ(deferred.get(), 4);
}

}  // namespace
}  // namespace flatshard
