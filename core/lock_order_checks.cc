#include "core/lock_order_checks.h"

#include <cstdlib>
#include <string_view>

#include "absl/synchronization/mutex.h"

namespace flatshard {

void SetLockOrderChecks(bool on) {
  absl::SetMutexDeadlockDetectionMode(on ? absl::OnDeadlockCycle::kAbort : absl::OnDeadlockCycle::kIgnore);
}

void SetLockOrderChecksFromEnvironment(const char* variable) {
  const char* value = std::getenv(variable);
  SetLockOrderChecks(value != nullptr && std::string_view(value) == "1");
}

}  // namespace flatshard
