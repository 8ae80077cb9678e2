// CancelOnSignal: Ctrl-C during `flatshard save`, `load` or `export`. While it lives,
// SIGINT and SIGTERM do not end the process: the first one cancels the client's
// checkpoint calls (Client::CancelCheckpointCalls: the servers stop and keep nothing of
// the call), saying so on `err`, and the command ends once the servers have let go; a
// second one, or one before there is a client, ends the process at once (exit status
// 130). The signals are blocked in the calling thread, and so in every thread it starts
// later (gRPC's), and taken by a thread of its own with sigtimedwait.
//
// Create it before the client (its threads must inherit the blocked signals) and destroy
// it on the same thread, after the client's calls have returned; not thread-safe
// otherwise.
//
//   CancelOnSignal interrupts(std::cerr, "export");
//   auto client = Client::Connect(options);
//   interrupts.Watch(**client);
//   status = (*client)->ExportStateDict(...);
//   if (!status.ok() && interrupts.signalled()) return 130;
#ifndef FLATSHARD_CLIENT_CLI_CANCEL_ON_SIGNAL_H_
#define FLATSHARD_CLIENT_CLI_CANCEL_ON_SIGNAL_H_

#include <signal.h>

#include <atomic>
#include <ostream>
#include <string>
#include <thread>

#include "flatshard/client.h"

namespace flatshard::cli {

class CancelOnSignal {
 public:
  CancelOnSignal(std::ostream& err, std::string command);
  ~CancelOnSignal();  // stops the thread; restores the signal mask
  CancelOnSignal(const CancelOnSignal&) = delete;
  CancelOnSignal& operator=(const CancelOnSignal&) = delete;

  // From now on, a first signal cancels `client`'s checkpoint calls (it must outlive this).
  void Watch(Client& client) { client_.store(&client); }
  // Whether a signal came (the command then exits with 130).
  bool signalled() const { return signalled_.load(); }

 private:
  void Run();

  std::ostream& err_;
  const std::string command_;
  sigset_t signals_;
  sigset_t previous_;
  std::atomic<Client*> client_{nullptr};
  std::atomic<bool> signalled_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_CANCEL_ON_SIGNAL_H_
