// SignalRoute: one thread takes a set of signals with Wait, whichever thread the kernel
// hands them to. Blocking them before any other thread starts is not enough: a library's
// thread or call may unblock them (seen on a device-tier server: a SIGTERM that arrived
// while the main thread was shutting down, not waiting, ended the process by its default
// action, though every thread blocked it while it served). So while a SignalRoute lives,
// a handler, which runs only in threads that do not block the signals, sends each on to
// the thread that made the route (or, run there while a call of its own had unblocked
// them, keeps it for its next Wait). A signal that comes while that thread is not waiting
// waits for its next Wait and, once it waits no more (a second SIGTERM during a graceful
// shutdown), changes nothing.
//
// Used by the server's main thread (SIGTERM, SIGINT, SIGHUP) and by the CLI's Ctrl-C
// watcher (client/cli/cancel_on_signal.h). At most one per process at a time; neither
// copyable nor movable; Wait only from the thread that made it, and destroy it there.
//
//   SignalRoute signals({SIGTERM, SIGINT, SIGHUP});  // before starting other threads
//   ... start the server ...
//   for (int s; (s = signals.Wait()) == SIGHUP;) reload();
//   shut down;
#ifndef FLATSHARD_CORE_SIGNAL_ROUTE_H_
#define FLATSHARD_CORE_SIGNAL_ROUTE_H_

#include <signal.h>

#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace flatshard {

class SignalRoute {
 public:
  // Blocks `signals` in the calling thread (and so in the threads it starts from then on)
  // and routes them to it from any thread that does not block them. Aborts, saying why,
  // when another SignalRoute lives (a programming error).
  explicit SignalRoute(std::initializer_list<int> signals);
  // Puts back the signals' previous actions (the calling thread's mask stays as it is).
  ~SignalRoute();
  SignalRoute(const SignalRoute&) = delete;
  SignalRoute& operator=(const SignalRoute&) = delete;

  // Waits up to `timeout` for the next of the signals (one that arrived since the route
  // was made, or since the last Wait, first) and returns its number; 0 when none came.
  int Wait(absl::Duration timeout = absl::InfiniteDuration());

 private:
  sigset_t signals_;
  std::vector<std::pair<int, struct sigaction>> previous_;
};

}  // namespace flatshard

#endif  // FLATSHARD_CORE_SIGNAL_ROUTE_H_
