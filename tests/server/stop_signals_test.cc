#include "server/stop_signals.h"

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

namespace flatshard::server {
namespace {

// What a server's main thread does, in a child process: takes the signals, then a thread
// unblocks them as a library's thread may. A signal sent while the main thread is not
// waiting reaches that thread; it must come to the main thread's next Wait, as must one
// the main thread takes while a call of its own has unblocked them, and one sent after
// the last Wait (during a shutdown) must not end the process. Exits 0 when all of it
// holds; a signal handed round without end ends it by SIGALRM.
void TakeSignalsBesideAThreadThatUnblocksThem() {
  alarm(10);
  StopSignals signals = StopSignals::Take();
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

TEST(StopSignalsTest, SignalsThatReachAnotherThreadComeToTheWaitingOneAndALateOneEndsNothing) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(TakeSignalsBesideAThreadThatUnblocksThem(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flatshard::server
