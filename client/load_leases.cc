#include "client/load_leases.h"

#include <utility>

#include "absl/time/clock.h"

namespace flatshard::client_internal {

LoadLeases::LoadLeases(std::function<absl::StatusOr<absl::Duration>(size_t)> renew)
    : renew_(std::move(renew)), thread_([this] { RenewLoop(); }) {}

LoadLeases::~LoadLeases() { (void)Stop(); }

void LoadLeases::Prepared(size_t server, absl::Duration held_for) {
  if (held_for <= absl::ZeroDuration()) return;
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  due_[server] = absl::Now() + held_for / 2;
  changed_ = true;
}

absl::Status LoadLeases::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  return failed_;
}

void LoadLeases::RenewLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [server, due] : due_) next = std::min(next, due);
    changed_ = false;
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](LoadLeases* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
                                return self->stopping_ || self->changed_;
                              },
                              this),
                          next);
    if (stopping_) return;
    for (auto it = due_.begin(); it != due_.end();) {
      if (it->second > absl::Now()) {
        ++it;
        continue;
      }
      const size_t server = it->first;
      mu_.Unlock();
      const absl::StatusOr<absl::Duration> held_for = renew_(server);
      mu_.Lock();
      if (stopping_) return;
      it = due_.find(server);  // the map may have grown meanwhile
      if (!held_for.ok()) {
        if (failed_.ok()) failed_ = held_for.status();
        it = due_.erase(it);
      } else if (*held_for <= absl::ZeroDuration()) {
        it = due_.erase(it);
      } else {
        it->second = absl::Now() + *held_for / 2;
        ++it;
      }
    }
  }
}

}  // namespace flatshard::client_internal
