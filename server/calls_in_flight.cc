#include "server/calls_in_flight.h"

namespace flatshard::server {

void CallsInFlight::Begin() {
  absl::MutexLock lock(&mu_);
  ++calls_;
}

void CallsInFlight::End() {
  absl::MutexLock lock(&mu_);
  --calls_;
}

int CallsInFlight::count() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

bool CallsInFlight::AwaitNone(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  const auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
}

}  // namespace flatshard::server
