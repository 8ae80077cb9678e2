#include "core/signal_route.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "absl/time/clock.h"

namespace flatshard {
namespace {

// Whether a route lives; the two below belong to it.
std::atomic<bool> route_lives = false;
// The thread that made the route: written before its handler is installed, read by it.
pthread_t routed_thread;
// A signal the handler took in the routed thread itself, which blocks them all but where
// a call of its own unblocks them for a while: sending it there again would only bring
// the handler back at once, so Wait reads it from here.
std::atomic<int> taken_by_routed_thread = 0;
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void SendToRoutedThread(int signal_number) {
  const int saved_errno = errno;
  if (pthread_equal(pthread_self(), routed_thread)) {
    taken_by_routed_thread.store(signal_number);
  } else {
    pthread_kill(routed_thread, signal_number);  // async-signal-safe
  }
  errno = saved_errno;
}

}  // namespace

SignalRoute::SignalRoute(std::initializer_list<int> signals) {
  if (route_lives.exchange(true)) {
    std::fputs("flatshard: a second SignalRoute while one lives\n", stderr);
    std::abort();
  }
  sigemptyset(&signals_);
  for (const int signal_number : signals) sigaddset(&signals_, signal_number);
  // Blocked first, so that the handler runs in this thread only where a call unblocks them.
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  routed_thread = pthread_self();
  taken_by_routed_thread.store(0);
  struct sigaction action = {};
  action.sa_handler = SendToRoutedThread;
  action.sa_flags = SA_RESTART;
  sigfillset(&action.sa_mask);
  for (const int signal_number : signals) {
    struct sigaction previous = {};
    sigaction(signal_number, &action, &previous);
    previous_.emplace_back(signal_number, previous);
  }
}

SignalRoute::~SignalRoute() {
  for (const auto& [signal_number, previous] : previous_) sigaction(signal_number, &previous, nullptr);
  route_lives.store(false);
}

int SignalRoute::Wait(absl::Duration timeout) {
  // Set only by the handler running in this thread, so never between this read and the
  // wait below, where this thread blocks the signals.
  if (const int taken = taken_by_routed_thread.exchange(0); taken != 0) return taken;
  if (timeout == absl::InfiniteDuration()) {
    int signal_number = 0;
    sigwait(&signals_, &signal_number);  // fails only for a set with no valid signal
    return signal_number;
  }
  for (const absl::Time deadline = absl::Now() + timeout;;) {
    const timespec left = absl::ToTimespec(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    const int signal_number = sigtimedwait(&signals_, nullptr, &left);
    if (signal_number > 0) return signal_number;
    if (errno != EINTR) return 0;  // EAGAIN: the time is up
  }
}

}  // namespace flatshard
