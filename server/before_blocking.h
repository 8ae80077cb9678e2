// What a server thread does before it blocks. A data connection's thread may hold its
// answers back while the worker's next pipelined request is already read
// (transport::Connection::SendOrHold); it installs a hook that sends them, and every wait
// a request may make (for a version, for this server's step in progress, for a save
// reading the version, for a checkpoint load, for a peer of the exchange or the
// gradient norm) runs the hook first, with no lock held: the worker may need those
// answers before it can send what ends the wait. Thread-local: a thread without a hook
// runs nothing, and a hook is its installing thread's alone.
//
//   const BlockingHook send_held([&conn] { (void)conn.SendHeld(); });  // the connection's thread
//   ...
//   BeforeBlocking();                                        // before a wait with no lock held
//   AwaitBlocking(mu_, absl::Condition(&ready), deadline);  // a wait under mu_, released for the hook
#ifndef FLATSHARD_SERVER_BEFORE_BLOCKING_H_
#define FLATSHARD_SERVER_BEFORE_BLOCKING_H_

#include <functional>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::server {

// Installs `hook` on this thread for its lifetime (the one before it comes back after).
class BlockingHook {
 public:
  explicit BlockingHook(std::function<void()> hook);
  ~BlockingHook();
  BlockingHook(const BlockingHook&) = delete;
  BlockingHook& operator=(const BlockingHook&) = delete;

 private:
  friend void BeforeBlocking();

  std::function<void()> hook_;
  BlockingHook* previous_;
};

// Runs this thread's hook, if it has one. Call with no lock held.
void BeforeBlocking();

// mu.AwaitWithDeadline(condition, deadline), running this thread's hook first (with `mu`
// released) when the condition does not hold yet. The calling thread holds `mu`.
bool AwaitBlocking(absl::Mutex& mu, const absl::Condition& condition,
                   absl::Time deadline = absl::InfiniteFuture()) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_BEFORE_BLOCKING_H_
