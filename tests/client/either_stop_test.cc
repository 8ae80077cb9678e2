// EitherStop: its token stops when either token does (also one that had stopped before),
// from any thread, and not before; a callback it no longer holds cannot reach it.
#include "client/either_stop.h"

#include <gtest/gtest.h>

#include <memory>
#include <stop_token>
#include <thread>

namespace flatshard::client_internal {
namespace {

TEST(EitherStopTest, EachTokenStopsItAndNothingElseDoes) {
  for (int which = 0; which < 2; ++which) {
    std::stop_source first, second;
    const EitherStop either(first.get_token(), second.get_token());
    EXPECT_TRUE(either.token().stop_possible());
    EXPECT_FALSE(either.token().stop_requested());
    std::thread([&] { (which == 0 ? first : second).request_stop(); }).join();
    EXPECT_TRUE(either.token().stop_requested()) << "token " << which;
  }
}

TEST(EitherStopTest, ATokenThatHadStoppedStopsItAtOnce) {
  std::stop_source stopped;
  stopped.request_stop();
  const EitherStop either(std::stop_token{}, stopped.get_token());
  EXPECT_TRUE(either.token().stop_requested());
}

TEST(EitherStopTest, TokensThatCannotStopLeaveItRunningAndItsEndUnregistersIt) {
  const EitherStop never(std::stop_token{}, std::stop_token{});
  EXPECT_FALSE(never.token().stop_requested());
  std::stop_source outlives;
  std::stop_token taken;
  {
    auto either = std::make_unique<EitherStop>(outlives.get_token(), std::stop_token{});
    taken = either->token();
  }
  outlives.request_stop();  // would write into the freed object if still registered
  EXPECT_FALSE(taken.stop_requested());
}

}  // namespace
}  // namespace flatshard::client_internal
