#include "server/caller_wait.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"

namespace flatshard::server {
namespace {

TEST(AskedAtMostEveryTest, AsksOncePerIntervalAndSaysFalseInBetween) {
  std::atomic<int> asked = 0;
  const CallerGone gone = AskedAtMostEvery(absl::Milliseconds(50), [&] {
    ++asked;
    return false;
  });
  EXPECT_FALSE(gone());
  EXPECT_EQ(asked.load(), 1);
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(gone());
  EXPECT_EQ(asked.load(), 1) << "asked again within the interval";
  absl::SleepFor(absl::Milliseconds(80));
  EXPECT_FALSE(gone());
  EXPECT_EQ(asked.load(), 2) << "not asked again once the interval had passed";
}

TEST(AskedAtMostEveryTest, OnceGoneAlwaysGoneWithoutAskingAgain) {
  std::atomic<int> asked = 0;
  std::atomic<bool> answer = false;
  const CallerGone gone = AskedAtMostEvery(absl::Milliseconds(1), [&] {
    ++asked;
    return answer.load();
  });
  EXPECT_FALSE(gone());
  answer = true;
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(gone());
  const int asked_when_gone = asked.load();
  answer = false;
  absl::SleepFor(absl::Milliseconds(5));
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(gone());
  EXPECT_EQ(asked.load(), asked_when_gone);
}

TEST(AskedAtMostEveryTest, ThreadsAskingAtOnceAskOncePerInterval) {
  std::atomic<int> asked = 0;
  const CallerGone gone = AskedAtMostEvery(absl::Hours(1), [&] {
    ++asked;
    return false;
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) EXPECT_FALSE(gone());
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(asked.load(), 1);
}

}  // namespace
}  // namespace flatshard::server
