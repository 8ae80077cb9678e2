#include "server/before_blocking.h"

#include <utility>

namespace flatshard::server {
namespace {

thread_local BlockingHook* installed = nullptr;

}  // namespace

BlockingHook::BlockingHook(std::function<void()> hook) : hook_(std::move(hook)), previous_(installed) {
  installed = this;
}

BlockingHook::~BlockingHook() { installed = previous_; }

void BeforeBlocking() {
  if (installed != nullptr) installed->hook_();
}

bool AwaitBlocking(absl::Mutex& mu, const absl::Condition& condition, absl::Time deadline) {
  if (installed != nullptr && !condition.Eval()) {
    mu.Unlock();
    BeforeBlocking();
    mu.Lock();
  }
  return mu.AwaitWithDeadline(condition, deadline);
}

}  // namespace flatshard::server
