// CallsInFlight: counts the control-plane calls a server is serving, from each one's
// Begin() to its End() (server/request_log.h's interceptor calls them: it lives from the
// call's arrival to its end, its handler returned and its status sent or the call
// cancelled). A shutdown waits on it to give the calls in progress a grace period, and
// none to connections that are only open; the status RPC reports the count. Thread-safe;
// outlives whatever begins and ends calls.
//
//   CallsInFlight calls;
//   calls.Begin(); ... calls.End();   // per call
//   calls.AwaitNone(absl::Now() + grace);  // then shut the server down at once
#ifndef FLATSHARD_SERVER_CALLS_IN_FLIGHT_H_
#define FLATSHARD_SERVER_CALLS_IN_FLIGHT_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::server {

class CallsInFlight {
 public:
  CallsInFlight() = default;
  CallsInFlight(const CallsInFlight&) = delete;
  CallsInFlight& operator=(const CallsInFlight&) = delete;

  // One call arrived, one ended: every Begin() has its End().
  void Begin();
  void End();

  // The calls begun and not yet ended.
  int count() const;

  // Waits until no call is in flight, or until `deadline`; true when none is.
  bool AwaitNone(absl::Time deadline) const;

 private:
  mutable absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CALLS_IN_FLIGHT_H_
