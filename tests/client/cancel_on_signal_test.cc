// CancelOnSignal (Ctrl-C on `flatshard save`, `load`, `export`): a first signal cancels,
// repeatedly, so that a call that begins just after it is cancelled too; a second one, or
// one before there is anything to cancel, quits at once with status 130; one handed to a
// thread that unblocked it cancels all the same. Each case runs in a child process (fork),
// whose only threads are its own, so that the signal reaches no thread of the test
// runner's that leaves SIGINT unblocked.
#include "client/cli/cancel_on_signal.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#include "absl/time/clock.h"

namespace flatshard::cli {
namespace {

// Runs `body` in a child process; its wait status.
int InChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// Waits up to 5 s for `done`.
bool Within5s(const std::function<bool()>& done) {
  for (const absl::Time until = absl::Now() + absl::Seconds(5); !done();) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST(CancelOnSignalTest, ASignalJustBeforeTheCallBeginsCancelsItAllTheSame) {
  const int status = InChild([] {
    std::ostringstream err;
    std::atomic<bool> in_call{false}, cancelled_in_call{false};
    std::atomic<int> cancels_before{0};
    CancelOnSignal interrupts(err, "save");  // after what its cancel uses, which outlives it
    interrupts.Watch([&] {
      if (in_call.load()) {
        cancelled_in_call.store(true);
      } else {
        ++cancels_before;
      }
    });
    kill(getpid(), SIGINT);
    if (!Within5s([&] { return cancels_before.load() > 0; })) return 2;  // nothing in progress to cancel yet
    in_call.store(true);                                                 // the call begins after the signal
    if (!Within5s([&] { return cancelled_in_call.load(); })) return 3;
    if (!interrupts.signalled()) return 4;
    if (err.str().find("flatshard save: cancelling on Interrupt") == std::string::npos) return 5;
    return 0;
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(CancelOnSignalTest, ASignalToAThreadThatUnblockedItCancelsAllTheSame) {
  const int status = InChild([] {
    std::ostringstream err;
    std::atomic<int> cancels{0};
    std::atomic<bool> unblocked{false}, done{false};
    CancelOnSignal interrupts(err, "export");
    interrupts.Watch([&] { ++cancels; });
    std::thread library_thread([&] {  // as a library's thread may
      sigset_t signals;
      sigemptyset(&signals);
      sigaddset(&signals, SIGINT);
      pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
      unblocked.store(true);
      while (!done.load()) absl::SleepFor(absl::Milliseconds(1));
    });
    while (!unblocked.load()) absl::SleepFor(absl::Milliseconds(1));
    pthread_kill(library_thread.native_handle(), SIGINT);
    const bool cancelled = Within5s([&] { return cancels.load() > 0; });
    done.store(true);
    library_thread.join();
    if (!cancelled) return 2;
    if (!interrupts.signalled()) return 3;
    return 0;
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(CancelOnSignalTest, ASecondSignalQuitsAtOnce) {
  const int status = InChild([] {
    std::ostringstream err;
    CancelOnSignal interrupts(err, "load");
    interrupts.Watch([] {});  // a call that does not end
    kill(getpid(), SIGINT);
    if (!Within5s([&] { return interrupts.signalled(); })) return 2;
    kill(getpid(), SIGTERM);
    absl::SleepFor(absl::Seconds(5));
    return 0;
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 130);
}

TEST(CancelOnSignalTest, ASignalBeforeThereIsAClientQuitsAtOnce) {
  const int status = InChild([] {
    std::ostringstream err;
    CancelOnSignal interrupts(err, "export");
    kill(getpid(), SIGINT);
    absl::SleepFor(absl::Seconds(5));
    return 0;
  });
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 130);
}

}  // namespace
}  // namespace flatshard::cli
