#include "server/log_throttle.h"

#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <thread>
#include <vector>

namespace flatshard::server {
namespace {

TEST(LogThrottleTest, LetsABurstThroughPerPeriodAndSaysHowManyItHeldBack) {
  LogThrottle throttle(3, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0), 0) << i;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0 + absl::Seconds(9)), std::nullopt);
  // The next period lets lines through again, the first saying how many were held back.
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0 + absl::Seconds(10)), 5);
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0 + absl::Seconds(10)), 0);
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0 + absl::Seconds(11)), 0);
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0 + absl::Seconds(11)), std::nullopt);
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0 + absl::Seconds(30)), 1);
}

TEST(LogThrottleTest, KindsAreThrottledApart) {
  LogThrottle throttle(1, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0), 0);
  EXPECT_EQ(throttle.Admit("rpc A UNAUTHENTICATED", t0), std::nullopt);
  EXPECT_EQ(throttle.Admit("rpc A INVALID_ARGUMENT", t0), 0) << "another code";
  EXPECT_EQ(throttle.Admit("rpc B UNAUTHENTICATED", t0), 0) << "another method";
}

// A flood that stops leaves lines held back that no later line of its kind will mention:
// TakeHeldBack hands them over once their period has ended (every kind with
// InfiniteFuture), each count once.
TEST(LogThrottleTest, LinesHeldBackWithNoneSinceAreTakenOnceTheirPeriodEnds) {
  LogThrottle throttle(1, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 4; ++i) (void)throttle.Admit("rpc B UNAUTHENTICATED", t0);  // 3 held back
  for (int i = 0; i < 3; ++i) (void)throttle.Admit("rpc A UNAUTHENTICATED", t0);  // 2
  (void)throttle.Admit("gather INVALID_ARGUMENT", t0);                               // none
  for (int i = 0; i < 2; ++i) (void)throttle.Admit("scatter NOT_FOUND", t0 + absl::Seconds(5));  // 1, later
  using Taken = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(throttle.TakeHeldBack(t0 + absl::Seconds(9)), Taken{}) << "no period has ended";
  EXPECT_EQ(throttle.TakeHeldBack(t0 + absl::Seconds(10)),
            (Taken{{"rpc A UNAUTHENTICATED", 2}, {"rpc B UNAUTHENTICATED", 3}}));
  EXPECT_EQ(throttle.TakeHeldBack(t0 + absl::Seconds(10)), Taken{}) << "each count once";
  EXPECT_EQ(throttle.TakeHeldBack(absl::InfiniteFuture()), (Taken{{"scatter NOT_FOUND", 1}}));
  // Taken, they are not said again by the next line of their kind.
  EXPECT_EQ(throttle.Admit("rpc B UNAUTHENTICATED", t0 + absl::Seconds(20)), 0);
}

TEST(LogThrottleTest, HeldBackIsSaidOnlyWhenThereWereAny) {
  EXPECT_EQ(LogThrottle::HeldBack(0), "");
  EXPECT_EQ(LogThrottle::HeldBack(7), " (7 more like it held back since the last such line)");
}

TEST(LogThrottleTest, ManyThreadsGetExactlyTheBurstThrough) {
  LogThrottle throttle(10, absl::Hours(1));
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) admitted += throttle.Admit("data plane connection").has_value() ? 1 : 0;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(admitted.load(), 10);
}

}  // namespace
}  // namespace flatshard::server
