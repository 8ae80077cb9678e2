#include "server/staged_loads.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace flatshard::server {
namespace {

uint64_t StagedBytes(const StagedGroups& groups) {
  uint64_t bytes = 0;
  for (const StagedGroup& group : groups) {
    bytes += group.shard.params.size();
    for (const auto& [name, buffer] : group.shard.state) bytes += buffer.size();
  }
  return bytes;
}

// As `flatshard status` names loads.
std::string LoadName(uint64_t load_id) { return absl::StrCat("load ", absl::Hex(load_id)); }

}  // namespace

StagedLoads::StagedLoads(absl::Duration timeout) : timeout_(timeout), expiry_([this] { ExpireLoads(); }) {}

StagedLoads::~StagedLoads() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  expiry_.join();
}

void StagedLoads::Add(uint64_t load_id, std::string name, std::string job, StagedGroups groups) {
  const absl::Time now = absl::Now();
  Load load{.row = {.load_id = load_id,
                    .name = std::move(name),
                    .job = std::move(job),
                    .bytes = StagedBytes(groups),
                    .staged_at = now,
                    .expires_at = now + timeout_},
            .groups = std::move(groups)};
  absl::MutexLock lock(&mu_);
  std::swap(loads_[load_id], load);  // a replaced load is freed with `load`, after the lock
  added_ = true;
}

absl::StatusOr<StagedLoads::Load*> StagedLoads::Find(uint64_t load_id, const std::string& name) {
  const auto it = loads_.find(load_id);
  if (it == loads_.end()) {
    // The latest drop of the id (a client may prepare one id again after a failure).
    const auto dropped =
        std::find_if(dropped_.rbegin(), dropped_.rend(), [&](const auto& entry) { return entry.first == load_id; });
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", name, "' was not prepared for loading here as ", LoadName(load_id),
        dropped == dropped_.rend() ? "" : absl::StrCat(": its staging was dropped (", dropped->second, ")")));
  }
  if (it->second.row.name != name) {
    return absl::FailedPreconditionError(
        absl::StrCat(LoadName(load_id), " stages checkpoint '", it->second.row.name, "', not '", name, "'"));
  }
  return &it->second;
}

absl::StatusOr<StagedGroups> StagedLoads::Take(uint64_t load_id, const std::string& name) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Load*> load = Find(load_id, name);
  if (!load.ok()) return load.status();
  StagedGroups groups = std::move((*load)->groups);
  loads_.erase(load_id);
  return groups;
}

absl::Status StagedLoads::Renew(uint64_t load_id, const std::string& name) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Load*> load = Find(load_id, name);
  if (!load.ok()) return load.status();
  // Later only: the expiry thread, waiting for the old expiry, then finds nothing due.
  (*load)->row.expires_at = absl::Now() + timeout_;
  return absl::OkStatus();
}

void StagedLoads::Abort(uint64_t load_id) {
  std::vector<StagedGroups> dropped;
  absl::MutexLock lock(&mu_);
  dropped = Remove([&](const Load& load) { return load.row.load_id == load_id; }, "aborted");
}

void StagedLoads::DropJob(const std::string& job) {
  std::vector<StagedGroups> dropped;
  absl::MutexLock lock(&mu_);
  dropped = Remove([&](const Load& load) { return load.row.job == job; }, absl::StrCat("job '", job, "' was deleted"));
}

std::vector<StagedLoadRow> StagedLoads::Rows() const {
  std::vector<StagedLoadRow> rows;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, load] : loads_) rows.push_back(load.row);
  return rows;
}

template <typename Predicate>
std::vector<StagedGroups> StagedLoads::Remove(Predicate drop, const std::string& why) {
  std::vector<StagedGroups> removed;
  for (auto it = loads_.begin(); it != loads_.end();) {
    if (drop(it->second)) {
      removed.push_back(std::move(it->second.groups));
      Forget(it->first, why);
      it = loads_.erase(it);
    } else {
      ++it;
    }
  }
  return removed;
}

void StagedLoads::Forget(uint64_t load_id, std::string why) {
  dropped_.emplace_back(load_id, std::move(why));
  if (dropped_.size() > kRemembered) dropped_.pop_front();
}

void StagedLoads::ExpireLoads() {
  const std::string why = absl::StrCat("no commit came within ", absl::FormatDuration(timeout_),
                                       " of its staging or last renewal (--staged_load_timeout)");
  for (;;) {
    std::vector<StagedGroups> expired;  // freed after the lock, at the end of the turn
    absl::MutexLock lock(&mu_);
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [id, load] : loads_) next = std::min(next, load.row.expires_at);
    added_ = false;
    mu_.AwaitWithDeadline(
        absl::Condition(
            +[](StagedLoads* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->stopping_ || self->added_; },
            this),
        next);
    if (stopping_) return;
    const absl::Time now = absl::Now();
    for (const auto& [id, load] : loads_) {
      if (load.row.expires_at > now) continue;
      spdlog::warn("{} of checkpoint '{}' for job '{}' dropped with its {} bytes: {}", LoadName(id), load.row.name,
                   load.row.job, load.row.bytes, why);
    }
    expired = Remove([&](const Load& load) { return load.row.expires_at <= now; }, why);
  }
}

}  // namespace flatshard::server
