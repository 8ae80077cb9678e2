// CancelOnSignal: Ctrl-C during `flatshard save`, `load` or `export`. While it lives,
// SIGINT and SIGTERM do not end the process: the first one cancels the client's
// checkpoint calls (Client::CancelCheckpointCalls: the servers stop and keep nothing of
// the call), saying so on `err`, and the command ends once the servers have let go; a
// second one, or one before there is a client, ends the process at once (exit status
// 130). The signals are blocked in the calling thread, and so in every thread it starts
// later (gRPC's), and taken by a thread of its own, to which they are routed from any
// thread that unblocks them (core/signal_route.h). Since a cancel
// reaches only the calls in progress, it is repeated every 100 ms until this is
// destroyed: a signal that comes just before the call begins cancels it all the same.
//
// Create it before the client (its threads must inherit the blocked signals) and destroy
// it on the same thread once the client's calls have returned, before the client (the
// cancel it repeats uses it); not thread-safe otherwise.
//
//   std::optional<CancelOnSignal> interrupts(std::in_place, std::cerr, "export");
//   auto client = Client::Connect(options);
//   interrupts->Watch([&c = **client] { c.CancelCheckpointCalls(); });
//   status = (*client)->ExportStateDict(...);
//   const bool signalled = interrupts->signalled();
//   interrupts.reset();
//   if (!status.ok() && signalled) return 130;
#ifndef FLATSHARD_CLIENT_CLI_CANCEL_ON_SIGNAL_H_
#define FLATSHARD_CLIENT_CLI_CANCEL_ON_SIGNAL_H_

#include <signal.h>

#include <atomic>
#include <functional>
#include <ostream>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "core/signal_route.h"

namespace flatshard::cli {

class CancelOnSignal {
 public:
  CancelOnSignal(std::ostream& err, std::string command);
  ~CancelOnSignal();  // stops the thread; restores the signals' actions and the mask
  CancelOnSignal(const CancelOnSignal&) = delete;
  CancelOnSignal& operator=(const CancelOnSignal&) = delete;

  // From now on, a signal calls `cancel` (what it uses must outlive this), and again every
  // 100 ms after.
  void Watch(std::function<void()> cancel);
  // Whether a signal came (the command then exits with 130).
  bool signalled() const { return signalled_.load(); }

 private:
  void Run(SignalRoute& route);

  std::ostream& err_;
  const std::string command_;
  sigset_t signals_;
  sigset_t previous_;
  absl::Mutex mu_;
  std::function<void()> cancel_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> signalled_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_CANCEL_ON_SIGNAL_H_
