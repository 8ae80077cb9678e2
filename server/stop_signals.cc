#include "server/stop_signals.h"

#include <pthread.h>

#include <atomic>
#include <cerrno>

namespace flatshard::server {
namespace {

constexpr int kTaken[] = {SIGTERM, SIGINT, SIGHUP};

// Written once by Take, before any handler is installed; read by the handler.
pthread_t waiting_thread;
// A signal the handler took in the waiting thread itself, which blocks them all but where
// a library's call unblocks them for a while: sending it there again would only bring the
// handler back at once, so Wait reads it from here.
std::atomic<int> taken_by_waiting_thread = 0;
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void SendToWaitingThread(int signal_number) {
  const int saved_errno = errno;
  if (pthread_equal(pthread_self(), waiting_thread)) {
    taken_by_waiting_thread.store(signal_number);
  } else {
    pthread_kill(waiting_thread, signal_number);  // async-signal-safe
  }
  errno = saved_errno;
}

}  // namespace

StopSignals StopSignals::Take() {
  sigset_t signals;
  sigemptyset(&signals);
  for (const int signal_number : kTaken) sigaddset(&signals, signal_number);
  // Blocked first, so that the handler runs in this thread only where a call unblocks them.
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  waiting_thread = pthread_self();
  struct sigaction action = {};
  action.sa_handler = SendToWaitingThread;
  action.sa_flags = SA_RESTART;
  sigfillset(&action.sa_mask);
  for (const int signal_number : kTaken) sigaction(signal_number, &action, nullptr);
  return StopSignals(signals);
}

int StopSignals::Wait() {
  // Set only by the handler running in this thread, so never between this read and
  // sigwait, where this thread blocks the signals.
  if (const int taken = taken_by_waiting_thread.exchange(0); taken != 0) return taken;
  int signal_number = 0;
  sigwait(&signals_, &signal_number);  // fails only for a set with no valid signal
  return signal_number;
}

}  // namespace flatshard::server
