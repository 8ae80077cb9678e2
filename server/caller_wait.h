// Waits that end when their caller goes away. A request that waits for what others
// bring (a version, a gradient norm) holds a server thread until then or its deadline;
// once its caller has gone (its gRPC call cancelled, its data connection closed) nobody
// can use the answer, so the wait asks `caller_gone` every kCallerCheck and ends.
//
//   absl::MutexLock lock(&mu_);
//   switch (AwaitWhileTheCallerWaits(mu_, absl::Condition(&ready), deadline, caller_gone)) { ... }
#ifndef FLATSHARD_SERVER_CALLER_WAIT_H_
#define FLATSHARD_SERVER_CALLER_WAIT_H_

#include <functional>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::server {

// Whether the caller of a waiting request has gone. Asked with the wait's mutex held:
// quick, and never takes that mutex.
using CallerGone = std::function<bool()>;

inline constexpr absl::Duration kCallerCheck = absl::Milliseconds(100);

// `ask`, consulted at most once per `interval` (the calls in between say false) and never
// again once it has said true. For a check that costs more than its callers' work
// between checks: a gRPC call's IsCancelled polls its completion queue (a lock and a
// wait, tens of microseconds), while a checkpoint writer asks before each piece it
// writes, 100000 times in a save of a model of many small tensors. Thread-safe.
CallerGone AskedAtMostEvery(absl::Duration interval, CallerGone ask);

enum class WaitOutcome { kReady, kTimedOut, kCallerGone };

// Waits on `mu`, which the calling thread holds, until `condition` holds (kReady),
// `deadline` passes (kTimedOut) or `caller_gone` (empty: never asked) says so
// (kCallerGone). Releases `mu` while it waits, as absl::Mutex::Await does, and runs the
// thread's hook before it blocks (AwaitBlocking, server/before_blocking.h).
WaitOutcome AwaitWhileTheCallerWaits(absl::Mutex& mu, const absl::Condition& condition, absl::Time deadline,
                                     const CallerGone& caller_gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CALLER_WAIT_H_
