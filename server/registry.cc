#include "server/registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard::server {

absl::Status NamingGroup(absl::string_view name, const absl::Status& status) {
  const std::string quoted = absl::StrCat("group '", name, "'");
  if (absl::StrContains(status.message(), quoted)) return status;
  return absl::Status(status.code(), absl::StrCat(quoted, ": ", status.message()));
}

absl::Status Registry::ConfigureJob(const std::string& job, const JobSettings& settings) {
  if (job.empty()) return absl::InvalidArgumentError("job: empty name");
  if (settings.num_workers < 1 || settings.num_workers > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers: ", settings.num_workers, ", must be in [1, 65536]"));
  }
  if (settings.max_grad_norm < 0 || std::isnan(settings.max_grad_norm)) {
    return absl::InvalidArgumentError("max_grad_norm: must be >= 0 (0: no clipping)");
  }
  if (settings.norm_type != 2.0 && !(std::isinf(settings.norm_type) && settings.norm_type > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("norm_type: ", settings.norm_type, "; supported: 2 and inf"));
  }
  if (settings.clipping() && settings.async) {
    return absl::InvalidArgumentError(
        "max_grad_norm: gradient clipping needs sync mode (a global norm per step)");
  }
  if (settings.skip_nonfinite && settings.async) {
    return absl::InvalidArgumentError(
        "skip_nonfinite: skipping steps needs sync mode (a global check per step)");
  }
  if (settings.replicas < 1 || num_servers_ % settings.replicas != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replicas: ", settings.replicas, " does not divide the cluster's ", num_servers_,
        " servers into equal replica groups"));
  }
  if (settings.hybrid() && settings.num_workers < settings.replicas) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replicas: ", settings.replicas, " replica groups for ", settings.num_workers,
        " workers; every replica group needs a worker (worker w belongs to replica w % ",
        settings.replicas, ")"));
  }
  if (settings.hybrid() && settings.async) {
    return absl::InvalidArgumentError(
        "replicas: hybrid sharding needs sync mode (replicas applying contributions as they "
        "arrive would drift apart)");
  }
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = jobs_.emplace(job, settings);
    if (!inserted && !(it->second == settings)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job, "' is already configured differently (num_workers ", it->second.num_workers, ", reduce ",
          it->second.reduce_mean ? "mean" : "sum", ", max_grad_norm ", it->second.max_grad_norm, ", ",
          it->second.async ? "async" : "sync", ", replicas ", it->second.replicas, ", skip_nonfinite ",
          it->second.skip_nonfinite ? "on" : "off", "); every worker must send the same settings"));
    }
    if (!inserted) return absl::OkStatus();  // another worker's call with the same settings
  }
  spdlog::info("job '{}' configured: workers {}, {}{}, reduce {}, max_grad_norm {}, replicas {}, skip_nonfinite {}",
               job, settings.num_workers, settings.async ? "async" : "sync",
               settings.async && settings.max_staleness >= 0
                   ? absl::StrCat(" (max_staleness ", settings.max_staleness, ")")
                   : "",
               settings.reduce_mean ? "mean" : "sum", settings.max_grad_norm, settings.replicas,
               settings.skip_nonfinite ? "on" : "off");
  return absl::OkStatus();
}

absl::StatusOr<Registry::Registration> Registry::RegisterGroup(const std::string& job,
                                                               const std::string& name,
                                                               std::vector<TensorSpec> tensors,
                                                               int64_t align,
                                                               const OptimizerConfig& optimizer) {
  std::vector<GroupRequest> one;
  one.push_back({name, std::move(tensors), align, optimizer});
  absl::StatusOr<std::vector<Registration>> registered = RegisterGroups(job, std::move(one));
  if (!registered.ok()) return registered.status();
  return std::move(registered->front());
}

absl::StatusOr<std::vector<Registry::Registration>> Registry::RegisterGroups(const std::string& job,
                                                                             std::vector<GroupRequest> groups) {
  const absl::StatusOr<JobSettings> settings = job_settings(job);
  if (!settings.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job, "' is not configured; call ConfigureJob first"));
  }
  const Placement placement = Placement::Of(rank_, num_servers_, settings->replicas);
  // Every spec is checked and laid out before the lock, and before anything is made.
  std::vector<FlatLayout> layouts;
  layouts.reserve(groups.size());
  absl::flat_hash_set<absl::string_view> names;
  for (GroupRequest& group : groups) {
    if (group.name.empty()) return absl::InvalidArgumentError("group: empty name");
    if (!names.insert(group.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("group '", group.name, "' is named twice"));
    }
    if (absl::Status valid = ValidateOptimizer(group.optimizer); !valid.ok()) return NamingGroup(group.name, valid);
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(std::move(group.tensors), group.align, placement.shards);
    if (!layout.ok()) return NamingGroup(group.name, layout.status());
    layouts.push_back(*std::move(layout));
  }
  // Under the lock: what is registered already (kept), what conflicts (refused), and,
  // with `made` (the groups created for the rest), their insertion. The groups are
  // created between two such passes, outside the lock: their memory takes time, during
  // which other jobs' requests look groups up.
  std::vector<Registration> registrations(groups.size());
  auto settle = [&](std::vector<std::shared_ptr<Group>>* made) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    FLATSHARD_RETURN_IF_ERROR(stopped_);
    // Read without the lock above: the job may have been deleted (and configured again)
    // since.
    if (const auto it = jobs_.find(job); it == jobs_.end() || !(it->second == *settings)) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job, "' was deleted while group '", groups[0].name,
                                                        "' was being registered; configure the job again"));
    }
    for (size_t i = 0; i < groups.size(); ++i) {
      const std::shared_ptr<Group>* ours = made != nullptr && (*made)[i] != nullptr ? &(*made)[i] : nullptr;
      const auto it = groups_.find({job, groups[i].name});
      if (it == groups_.end()) {
        if (made != nullptr && ours == nullptr) {  // there before, gone with its job since
          return absl::FailedPreconditionError(absl::StrCat("job '", job, "' was deleted while group '",
                                                            groups[i].name, "' was being registered"));
        }
        registrations[i] = {};
        continue;
      }
      if (!it->second->SameSpec(ours != nullptr ? (*ours)->layout() : layouts[i], groups[i].optimizer)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "group '", groups[i].name, "' in job '", job,
            "' is already registered with a different spec (tensors, align or optimizer)"));
      }
      registrations[i] = {it->second, false};  // also one that a racing call made meanwhile
    }
    if (made == nullptr) return absl::OkStatus();
    for (size_t i = 0; i < groups.size(); ++i) {
      if (registrations[i].group != nullptr) continue;
      registrations[i] = {(*made)[i], true};
      groups_[{job, groups[i].name}] = (*made)[i];
    }
    return absl::OkStatus();
  };
  {
    absl::MutexLock lock(&mu_);
    FLATSHARD_RETURN_IF_ERROR(settle(nullptr));
  }
  std::vector<std::shared_ptr<Group>> made(groups.size());
  // The small groups' buffers, a few mapped blocks instead of an allocation each; a group
  // made alone allocates its own (a block would hold its memory for it alone).
  HostSlab small_buffers;
  const auto making = std::count_if(registrations.begin(), registrations.end(),
                                    [](const Registration& r) { return r.group == nullptr; });
  for (size_t i = 0; i < groups.size(); ++i) {
    if (registrations[i].group != nullptr) continue;
    absl::StatusOr<std::shared_ptr<Group>> group =
        Group::Create(job, groups[i].name, std::move(layouts[i]), placement, *settings, groups[i].optimizer, tier_,
                      pool_, making > 1 ? &small_buffers : nullptr);
    if (!group.ok()) return NamingGroup(groups[i].name, group.status());  // `made` goes with its memory
    made[i] = *std::move(group);
  }
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(settle(&made));
  return registrations;
}

absl::StatusOr<std::shared_ptr<Group>> Registry::FindGroup(const std::string& job,
                                                           const std::string& name) const {
  absl::MutexLock lock(&mu_);
  const auto it = groups_.find({job, name});
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown group '", name, "' in job '", job, "'"));
  }
  return it->second;
}

absl::StatusOr<std::vector<std::shared_ptr<Group>>> Registry::DeleteJob(const std::string& job) {
  std::vector<std::shared_ptr<Group>> removed;
  {
    absl::MutexLock lock(&mu_);
    if (jobs_.erase(job) == 0) return absl::NotFoundError(absl::StrCat("job '", job, "' is not configured"));
    for (auto it = groups_.lower_bound({job, ""}); it != groups_.end() && it->first.first == job;) {
      removed.push_back(std::move(it->second));
      it = groups_.erase(it);
    }
  }
  for (const std::shared_ptr<Group>& group : removed) {
    group->Close(
        absl::NotFoundError(absl::StrCat("job '", job, "' was deleted, and group '", group->name(), "' with it")));
  }
  return removed;
}

void Registry::Stop(const absl::Status& why) {
  std::vector<std::shared_ptr<Group>> open;
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_.ok()) return;
    stopped_ = why;  // registrations from now on are refused with it
    for (const auto& [key, group] : groups_) open.push_back(group);
  }
  for (const std::shared_ptr<Group>& group : open) group->Close(why);
}

std::vector<std::shared_ptr<Group>> Registry::job_groups(const std::string& job) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Group>> result;
  for (auto it = groups_.lower_bound({job, ""}); it != groups_.end() && it->first.first == job; ++it) {
    result.push_back(it->second);
  }
  return result;
}

std::map<std::string, JobSettings> Registry::jobs() const {
  absl::MutexLock lock(&mu_);
  return jobs_;
}

absl::StatusOr<JobSettings> Registry::job_settings(const std::string& job) const {
  absl::MutexLock lock(&mu_);
  const auto it = jobs_.find(job);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job '", job, "'"));
  return it->second;
}

absl::StatusOr<Placement> Registry::job_placement(const std::string& job) const {
  FLATSHARD_ASSIGN_OR_RETURN(const JobSettings settings, job_settings(job));
  return Placement::Of(rank_, num_servers_, settings.replicas);
}

std::vector<std::shared_ptr<Group>> Registry::groups() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Group>> result;
  for (const auto& [key, group] : groups_) result.push_back(group);
  return result;
}

}  // namespace flatshard::server
