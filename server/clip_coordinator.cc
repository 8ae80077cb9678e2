#include "server/clip_coordinator.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard::server {

ClipCoordinator::ClipCoordinator(Registry& registry, int rank, int num_servers, SendPartial send)
    : registry_(registry), rank_(rank), num_servers_(num_servers), send_(std::move(send)) {}

ClipCoordinator::StepState& ClipCoordinator::State(const std::string& job, int64_t step,
                                                   const Placement& placement) {
  StepState& state = steps_[{job, step}];
  if (state.partials.empty()) state.partials.resize(placement.shards);
  return state;
}

absl::Status ClipCoordinator::OnGroupReduced(const std::string& job, int64_t step) {
  FLATSHARD_ASSIGN_OR_RETURN(const JobSettings settings, registry_.job_settings(job));
  FLATSHARD_ASSIGN_OR_RETURN(const Placement placement, registry_.job_placement(job));
  double partial = 0.0;
  uint64_t epoch = 0;  // of the state the share is computed from
  {
    absl::MutexLock lock(&mu_);
    epoch = epochs_[job];
    StepState& state = State(job, step, placement);
    if (state.shared) return absl::OkStatus();
    bool any = false;
    for (const auto& group : registry_.job_groups(job)) {  // name order
      if (!group->in_norm() || group->version() != step) continue;  // frozen, or buffers
      if (!group->reduced_at(step)) return absl::OkStatus();  // others still pending
      any = true;
      FLATSHARD_ASSIGN_OR_RETURN(const double share, group->NormPartial(settings.norm_type));
      partial = std::isinf(settings.norm_type) ? std::max(partial, share) : partial + share;
      if (std::isnan(share)) partial = share;
    }
    if (!any) return absl::OkStatus();
    state.shared = true;
  }
  // Every replica group reduced the same gradient: the norm is its own replica's.
  for (int shard = 0; shard < placement.shards; ++shard) {
    const int peer = placement.replica * placement.shards + shard;
    if (peer == rank_) continue;
    if (absl::Status sent = send_(peer, job, step, partial, epoch); !sent.ok()) {
      {
        absl::MutexLock lock(&mu_);  // a later OnGroupReduced sends it again (unless a load came)
        auto it = steps_.find({job, step});
        if (it != steps_.end() && epochs_[job] == epoch) it->second.shared = false;
      }
      return absl::UnavailableError(absl::StrCat(
          "contribution recorded, but this server's gradient-norm share for job '", job,
          "' step ", step, " could not reach server ", peer, ": ", sent.message(),
          "; send the contribution again to retry"));
    }
  }
  return RecordPartial(job, step, rank_, partial, epoch);
}

absl::Status ClipCoordinator::RecordPartial(const std::string& job, int64_t step, int rank, double partial,
                                            uint64_t epoch) {
  if (rank < 0 || rank >= num_servers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("norm share from rank ", rank, " outside the cluster of ", num_servers_));
  }
  FLATSHARD_ASSIGN_OR_RETURN(const JobSettings settings, registry_.job_settings(job));
  if (!settings.needs_norm()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", job, "' neither clips gradients nor skips non-finite steps"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(const Placement placement, registry_.job_placement(job));
  if (rank / placement.shards != placement.replica) {
    return absl::InvalidArgumentError(absl::StrCat(
        "norm share from server ", rank, " of replica group ", rank / placement.shards,
        " for job '", job, "'; this server combines replica group ", placement.replica, "'s"));
  }
  absl::MutexLock lock(&mu_);
  if (epoch != epochs_[job]) {
    if (left_epochs_[job].contains(epoch)) return absl::OkStatus();  // from the state a load replaced
    return absl::UnavailableError(
        absl::StrCat("job '", job, "': the norm share of step ", step, " from server ", rank,
                     " follows a checkpoint load that this server has not committed yet; send it again"));
  }
  StepState& state = State(job, step, placement);
  const int shard = rank % placement.shards;
  if (state.partials[shard].has_value()) return absl::OkStatus();
  state.partials[shard] = partial;
  if (++state.received < placement.shards) return absl::OkStatus();

  // Every server combines the shares in shard order: the same bits everywhere.
  const bool inf_norm = std::isinf(settings.norm_type);
  double combined = 0.0;
  for (const auto& share : state.partials) {
    combined = inf_norm ? std::max(combined, *share) : combined + *share;
    if (std::isnan(*share)) combined = *share;
  }
  steps_.erase({job, step});
  const double total_norm = inf_norm ? combined : std::sqrt(combined);
  std::map<int64_t, double>& kept = norms_[job];
  kept[step] = total_norm;
  while (kept.size() > kKeptNorms) kept.erase(kept.begin());
  // Without clipping the coefficient is 1: the optimizer steps on the gradient as it is.
  const float clip_coef =
      settings.clipping() ? static_cast<float>(settings.max_grad_norm / (total_norm + 1e-6)) : 1.0f;
  const bool skip = settings.skip_nonfinite && !std::isfinite(total_norm);
  if (skip) ++skipped_steps_[job];
  absl::Status status;
  for (const auto& group : registry_.job_groups(job)) {
    if (!group->reduced_at(step)) continue;
    status.Update(skip ? group->SkipStep(step) : group->FinishClippedStep(step, clip_coef));
  }
  return status;
}

ClipCoordinator::JobNorms ClipCoordinator::Norms(const std::string& job) {
  absl::MutexLock lock(&mu_);
  JobNorms result;
  if (const auto it = skipped_steps_.find(job); it != skipped_steps_.end()) result.skipped_steps = it->second;
  if (const auto it = norms_.find(job); it != norms_.end() && !it->second.empty()) {
    result.last_step = it->second.rbegin()->first;
    result.last_norm = it->second.rbegin()->second;
  }
  return result;
}

void ClipCoordinator::OnLoad(const std::string& job, uint64_t load_id) {
  absl::MutexLock lock(&mu_);
  norms_.erase(job);
  std::erase_if(steps_, [&job](const auto& entry) { return entry.first.first == job; });
  uint64_t& epoch = epochs_[job];
  left_epochs_[job].insert(epoch);
  epoch = load_id;
}

void ClipCoordinator::ForgetJob(const std::string& job) {
  absl::MutexLock lock(&mu_);
  norms_.erase(job);
  std::erase_if(steps_, [&job](const auto& entry) { return entry.first.first == job; });
  skipped_steps_.erase(job);
  epochs_.erase(job);
  left_epochs_.erase(job);
  ++deletions_[job];  // the waits' conditions see it when the lock is released
}

void ClipCoordinator::Stop(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (stopped_.ok()) stopped_ = why;  // the waits' conditions see it when the lock is released
}

absl::StatusOr<double> ClipCoordinator::TotalNorm(const std::string& job, int64_t step, absl::Time deadline,
                                                  const CallerGone& caller_gone) {
  FLATSHARD_ASSIGN_OR_RETURN(const JobSettings settings, registry_.job_settings(job));
  if (!settings.needs_norm()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", job, "' computes no gradient norm; set max_grad_norm (clipping) or "
        "skip_nonfinite"));
  }
  absl::MutexLock lock(&mu_);
  // Looked up afresh each time: OnLoad may drop the job's map while this waits.
  auto kept = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> const double* {
    const auto it = norms_.find(job);
    if (it == norms_.end()) return nullptr;
    const auto norm = it->second.find(step);
    return norm == it->second.end() ? nullptr : &norm->second;
  };
  bool applied = false;  // a step this server applied without its norm coming back
  for (const auto& group : registry_.job_groups(job)) {
    if (group->in_norm() && group->version() > step) applied = true;
  }
  if (applied && kept() == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "job '", job, "': the norm of step ", step, " is not kept here (the last ", kKeptNorms,
        " steps are, since this server started or last loaded a checkpoint)"));
  }
  auto deletions = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto it = deletions_.find(job);
    return it == deletions_.end() ? int64_t{0} : it->second;
  };
  auto was_deleted = [&] {
    return absl::NotFoundError(absl::StrCat("job '", job, "' was deleted while waiting for the norm of step ", step));
  };
  const int64_t deleted = deletions();
  // Deleted between the look-up above and `deleted` (the registry goes first).
  if (!registry_.job_settings(job).ok()) return was_deleted();
  auto known = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return kept() != nullptr || deletions() != deleted || !stopped_.ok();
  };
  switch (AwaitWhileTheCallerWaits(mu_, absl::Condition(&known), deadline, caller_gone)) {
    case WaitOutcome::kReady:
      break;
    case WaitOutcome::kTimedOut:
      return absl::DeadlineExceededError(
          absl::StrCat("job '", job, "': the gradient norm of step ", step, " is not known yet"));
    case WaitOutcome::kCallerGone:
      return absl::CancelledError(absl::StrCat("the caller went away while waiting for the gradient norm of step ",
                                               step, " of job '", job, "'"));
  }
  if (kept() == nullptr) return stopped_.ok() ? was_deleted() : stopped_;
  return *kept();
}

}  // namespace flatshard::server
