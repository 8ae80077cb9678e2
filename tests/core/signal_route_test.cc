#include "core/signal_route.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatshard {
namespace {

// What a server's main thread does, in a child process: routes the signals to itself,
// then a thread unblocks them as a library's thread may. A signal sent while the main thread is not
// waiting reaches that thread; it must come to the main thread's next Wait, as must one
// the main thread takes while a call of its own has unblocked them, and one sent after
// the last Wait (during a shutdown) must not end the process. Exits 0 when all of it
// holds; a signal handed round without end ends it by SIGALRM.
void TakeSignalsBesideAThreadThatUnblocksThem() {
  alarm(10);
  SignalRoute signals({SIGTERM, SIGINT, SIGHUP});
  std::atomic<bool> unblocked = false;
  std::atomic<bool> done = false;
  std::thread library_thread([&] {
    sigset_t all;
    sigemptyset(&all);
    for (const int signal_number : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&all, signal_number);
    pthread_sigmask(SIG_UNBLOCK, &all, nullptr);
    unblocked = true;
    while (!done) absl::SleepFor(absl::Milliseconds(1));
  });
  while (!unblocked) absl::SleepFor(absl::Milliseconds(1));
  const auto expect_next = [&](int sent) {
    if (const int got = signals.Wait(); got != sent) {
      std::fprintf(stderr, "sent %s, Wait returned %d\n", strsignal(sent), got);
      std::_Exit(3);
    }
  };
  for (const int sent : {SIGTERM, SIGHUP, SIGINT}) {
    kill(getpid(), sent);
    absl::SleepFor(absl::Milliseconds(20));  // delivered while this thread is not waiting
    expect_next(sent);
  }
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
  pthread_kill(pthread_self(), SIGTERM);  // taken here at once, by the handler
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  expect_next(SIGTERM);
  kill(getpid(), SIGTERM);  // a second stop, after the last Wait
  absl::SleepFor(absl::Milliseconds(100));
  done = true;
  library_thread.join();
  std::_Exit(0);
}

TEST(SignalRouteTest, SignalsThatReachAnotherThreadComeToTheWaitingOneAndALateOneEndsNothing) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(TakeSignalsBesideAThreadThatUnblocksThem(), ::testing::ExitedWithCode(0), "");
}

std::atomic<int> usr1_handled = 0;
extern "C" void CountUsr1(int) { ++usr1_handled; }

// A Wait with a timeout, in a child process: it ends with 0 when no signal came and with
// the signal when one did; the route's end puts back the action it found, and a second
// route may follow the first. Exits 0 when all of it holds.
void WaitWithATimeoutThenEndTheRoute() {
  alarm(10);
  struct sigaction count = {};
  count.sa_handler = CountUsr1;
  sigaction(SIGUSR1, &count, nullptr);
  {
    SignalRoute route({SIGUSR1});
    const absl::Time start = absl::Now();
    if (const int got = route.Wait(absl::Milliseconds(50)); got != 0) std::_Exit(2);
    if (absl::Now() - start < absl::Milliseconds(50)) std::_Exit(3);
    kill(getpid(), SIGUSR1);
    if (const int got = route.Wait(absl::Seconds(5)); got != SIGUSR1) std::_Exit(4);
    if (usr1_handled != 0) std::_Exit(5);
  }
  SignalRoute second({SIGUSR2});  // SIGUSR1 is still blocked here, but no longer routed
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  kill(getpid(), SIGUSR1);
  pthread_sigmask(SIG_UNBLOCK, &usr1, nullptr);  // the pending one reaches the old handler
  if (usr1_handled != 1) std::_Exit(6);
  kill(getpid(), SIGUSR2);
  if (const int got = second.Wait(absl::Seconds(5)); got != SIGUSR2) std::_Exit(7);
  std::_Exit(0);
}

TEST(SignalRouteTest, AWaitEndsWithTheSignalOrAtItsTimeoutAndTheRoutesEndPutsBackTheOldAction) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(WaitWithATimeoutThenEndTheRoute(), ::testing::ExitedWithCode(0), "");
}

TEST(SignalRouteTest, ASecondRouteWhileOneLivesIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        SignalRoute first({SIGUSR1});
        SignalRoute second({SIGUSR2});
      },
      "a second SignalRoute while one lives");
}

}  // namespace
}  // namespace flatshard
