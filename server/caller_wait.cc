#include "server/caller_wait.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

#include "server/before_blocking.h"

namespace flatshard::server {

WaitOutcome AwaitWhileTheCallerWaits(absl::Mutex& mu, const absl::Condition& condition, absl::Time deadline,
                                     const CallerGone& caller_gone) {
  if (!caller_gone) return AwaitBlocking(mu, condition, deadline) ? WaitOutcome::kReady : WaitOutcome::kTimedOut;
  while (true) {
    const absl::Time until = std::min(deadline, absl::Now() + kCallerCheck);
    if (AwaitBlocking(mu, condition, until)) return WaitOutcome::kReady;
    if (until >= deadline) return WaitOutcome::kTimedOut;
    if (caller_gone()) return WaitOutcome::kCallerGone;
  }
}

CallerGone AskedAtMostEvery(absl::Duration interval, CallerGone ask) {
  struct Asked {
    std::atomic<int64_t> next_ns{0};  // asking before this says false
    std::atomic<bool> gone{false};
  };
  auto asked = std::make_shared<Asked>();
  const int64_t interval_ns = absl::ToInt64Nanoseconds(interval);
  return [asked, interval_ns, ask = std::move(ask)] {
    if (asked->gone.load(std::memory_order_acquire)) return true;
    const int64_t now = absl::GetCurrentTimeNanos();
    int64_t next = asked->next_ns.load(std::memory_order_relaxed);
    // One caller per interval asks: the others say false meanwhile.
    if (now < next || !asked->next_ns.compare_exchange_strong(next, now + interval_ns)) return false;
    if (!ask()) return false;
    asked->gone.store(true, std::memory_order_release);
    return true;
  };
}

}  // namespace flatshard::server
