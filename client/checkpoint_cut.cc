#include "client/checkpoint_cut.h"

#include <algorithm>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"

namespace flatshard::client_internal {

namespace {

// Whether a server holds `worker`'s gradient of `job`'s `group` for `step`, which it has
// not applied yet. The worker sent it; a load since may have dropped it, and then the
// step waits for this worker to send it again.
bool HoldsGradient(const std::string& job, const std::string& group, int64_t step, int worker,
                   const std::vector<v1::ServerStatus>& statuses) {
  for (const v1::ServerStatus& status : statuses) {
    for (const v1::GroupStatus& held : status.groups()) {
      if (held.job() == job && held.group() == group && held.version() == step &&
          absl::c_linear_search(held.step_contributors(), worker)) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace

std::map<std::string, int64_t> ServerVersions(const std::string& job, const v1::ServerStatus& status) {
  std::map<std::string, int64_t> versions;
  for (const v1::GroupStatus& group : status.groups()) {
    if (group.job() == job) versions[group.group()] = group.version();
  }
  return versions;
}

absl::StatusOr<std::map<std::string, int64_t>> ChooseCut(const std::string& job,
                                                         const std::vector<v1::ServerStatus>& statuses,
                                                         const SentSteps& sent, const CutAt& at) {
  std::map<std::string, int64_t> cut;
  std::map<std::string, int64_t> trained;  // group -> the highest version it reached
  bool async = false;
  bool steps_together = false;  // every step waits for the job's global norm
  for (const v1::ServerStatus& status : statuses) {
    for (const auto& [group, version] : ServerVersions(job, status)) cut[group] = std::max(cut[group], version);
    for (const v1::GroupStatus& group : status.groups()) {
      if (group.job() == job && group.optimizer() != "frozen") trained[group.group()] = cut[group.group()];
    }
    for (const v1::JobStatus& settings : status.jobs()) {
      if (settings.job() != job) continue;
      async |= settings.mode() == "async";
      steps_together |= settings.mode() == "sync" && (settings.max_grad_norm() > 0 || settings.skip_nonfinite());
    }
  }
  const auto [lowest, highest] = std::minmax_element(trained.begin(), trained.end(),
                                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  switch (at.kind()) {
    case CutAt::Kind::kVersion:
      if (at.version() < 0) return absl::InvalidArgumentError(absl::StrCat("cut at version ", at.version()));
      if (highest != trained.end() && highest->second > at.version()) {
        return absl::FailedPreconditionError(absl::StrCat("group '", highest->first, "' of job '", job,
                                                          "' is at version ", highest->second,
                                                          ", past the cut at version ", at.version()));
      }
      for (const auto& [group, version] : trained) cut[group] = at.version();
      return cut;
    case CutAt::Kind::kStepBoundary:
      if (async) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job '", job, "' is asynchronous: each gradient steps on its own, so its groups share no step boundary"));
      }
      if (sent.InsideStep()) {
        return absl::FailedPreconditionError(
            "this client is inside a step (it has sent some of the step's gradients, not all), whose end "
            "would wait for the rest; cut at the step boundary between steps");
      }
      if (highest != trained.end() && highest->second - lowest->second > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job '", job, "' has no step boundary: its groups are at versions ", lowest->second, " ('", lowest->first,
            "') to ", highest->second, " ('", highest->first,
            "'), more than a step apart, so they do not step together or do not count their steps alike; cut now "
            "instead"));
      }
      break;
    case CutAt::Kind::kDefault:
      break;
  }
  for (const auto& [group, step] : sent.AtBoundary()) {
    auto it = cut.find(group);
    if (it != cut.end() && it->second == step && HoldsGradient(job, group, step, sent.worker_rank(), statuses)) {
      it->second = step + 1;
    }
  }
  // A job whose groups take each step together (once its global norm is known) is cut
  // at its step boundary by default too: groups seen behind the others are in the middle
  // of that step's last phase, which needs nothing more from the workers.
  const bool one_step_apart = highest == trained.end() || highest->second - lowest->second <= 1;
  if (at.kind() == CutAt::Kind::kStepBoundary || (steps_together && one_step_apart)) {
    int64_t boundary = 0;
    for (const auto& [group, version] : trained) boundary = std::max(boundary, cut[group]);
    for (const auto& [group, version] : trained) cut[group] = boundary;
  }
  return cut;
}

absl::Status ExplainWait(const absl::Status& pinned, const SentSteps& sent, const CutAt& at) {
  if (!absl::IsDeadlineExceeded(pinned)) return pinned;
  std::string why;
  switch (at.kind()) {
    case CutAt::Kind::kVersion:
      why = absl::StrCat("the cut is at version ", at.version(), "; is the job training towards it?");
      break;
    case CutAt::Kind::kStepBoundary:
      why =
          "the cut is at the end of the step in progress, which needs every worker's gradient; is a worker "
          "behind or gone?";
      break;
    case CutAt::Kind::kDefault:
      if (sent.AtBoundary().empty()) return pinned;
      why =
          "the cut is after the step this worker sent last, which needs every worker's gradient; is a worker "
          "behind or gone?";
      break;
  }
  return absl::Status(pinned.code(), absl::StrCat(pinned.message(), " (", why, ")"));
}

int PinRounds(const CutAt& at) { return at.kind() == CutAt::Kind::kDefault ? 10 : 1; }

}  // namespace flatshard::client_internal
