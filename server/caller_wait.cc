#include "server/caller_wait.h"

#include <algorithm>

namespace flatshard::server {

WaitOutcome AwaitWhileTheCallerWaits(absl::Mutex& mu, const absl::Condition& condition, absl::Time deadline,
                                     const CallerGone& caller_gone) {
  if (!caller_gone) return mu.AwaitWithDeadline(condition, deadline) ? WaitOutcome::kReady : WaitOutcome::kTimedOut;
  while (true) {
    const absl::Time until = std::min(deadline, absl::Now() + kCallerCheck);
    if (mu.AwaitWithDeadline(condition, until)) return WaitOutcome::kReady;
    if (until >= deadline) return WaitOutcome::kTimedOut;
    if (caller_gone()) return WaitOutcome::kCallerGone;
  }
}

}  // namespace flatshard::server
