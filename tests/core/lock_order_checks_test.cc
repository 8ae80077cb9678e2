#include "core/lock_order_checks.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "absl/synchronization/mutex.h"

namespace flatshard {
namespace {

constexpr char kVariable[] = "FLATSHARD_TEST_LOCK_ORDER_CHECKS";

// Takes a then b, later b then a: a cycle in the order locks are taken (one thread, so
// never an actual deadlock), which the checks catch.
void TakeTwoLocksInBothOrders() {
  absl::Mutex a, b;
  {
    absl::MutexLock first(&a);
    absl::MutexLock second(&b);
  }
  {
    absl::MutexLock first(&b);
    absl::MutexLock second(&a);
  }
}

TEST(LockOrderChecksDeathTest, OnACycleInTheOrderLocksAreTakenEndsTheProcess) {
  EXPECT_DEATH(
      {
        SetLockOrderChecks(true);
        TakeTwoLocksInBothOrders();
      },
      "deadlock");
  EXPECT_DEATH(
      {
        setenv(kVariable, "1", 1);
        SetLockOrderChecksFromEnvironment(kVariable);
        TakeTwoLocksInBothOrders();
      },
      "deadlock");
}

TEST(LockOrderChecksTest, OffTheCycleGoesUnnoticedAndOnlyAOneInTheEnvironmentTurnsThemOn) {
  SetLockOrderChecks(false);
  TakeTwoLocksInBothOrders();
  for (const char* value : {"0", "", "true"}) {
    setenv(kVariable, value, 1);
    SetLockOrderChecksFromEnvironment(kVariable);
    TakeTwoLocksInBothOrders();
  }
  unsetenv(kVariable);
  SetLockOrderChecksFromEnvironment(kVariable);
  TakeTwoLocksInBothOrders();
  SetLockOrderChecks(true);  // back to this test binary's default (Abseil without NDEBUG)
}

}  // namespace
}  // namespace flatshard
