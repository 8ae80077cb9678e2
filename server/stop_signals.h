// StopSignals: the server's main thread takes the signals that stop it (SIGTERM, SIGINT)
// or reload its TLS files (SIGHUP) with sigwait, whichever thread the kernel hands them
// to. Blocking them before any thread starts is not enough: a library's thread or call
// may unblock them (seen on a device-tier server: a SIGTERM that arrived while the main
// thread was shutting down, not waiting, ended the process by its default action, though
// every thread blocked them while it served). So a handler, which runs only in threads
// that do not block them, sends the signal on to the main thread (or, run there while a
// call had unblocked them, keeps it), where it waits for the next Wait and, once the
// server has stopped waiting (a second SIGTERM during a graceful shutdown), changes
// nothing. One per process, made by the main thread before it starts any other; neither
// copyable nor movable.
//
//   StopSignals signals = StopSignals::Take();
//   ... start the server ...
//   for (int s; (s = signals.Wait()) == SIGHUP;) reload();
//   shut down;
#ifndef FLATSHARD_SERVER_STOP_SIGNALS_H_
#define FLATSHARD_SERVER_STOP_SIGNALS_H_

#include <signal.h>

namespace flatshard::server {

class StopSignals {
 public:
  // Blocks SIGTERM, SIGINT and SIGHUP in the calling thread (and so in the threads it
  // starts from then on) and routes them to it from any thread that does not block them.
  static StopSignals Take();

  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Waits for the next of the three signals (one that arrived since Take, or since the
  // last Wait, first) and returns its number. Call only from the thread that called Take.
  int Wait();

 private:
  explicit StopSignals(const sigset_t& signals) : signals_(signals) {}

  sigset_t signals_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_STOP_SIGNALS_H_
