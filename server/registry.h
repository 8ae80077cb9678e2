// Registry: the jobs and groups this server holds. Registration is idempotent: the same
// spec returns the same group, a different spec under the same name is refused. A job is
// held until it is deleted.
// Thread-safe. Groups are shared_ptr so requests in flight keep them alive.
//
//   FLATSHARD_RETURN_IF_ERROR(registry.ConfigureJob("default", {.num_workers = 2}));
//   FLATSHARD_ASSIGN_OR_RETURN(auto group, registry.FindGroup("default", "mlp.0"));
#ifndef FLATSHARD_SERVER_REGISTRY_H_
#define FLATSHARD_SERVER_REGISTRY_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/compute_pool.h"
#include "server/group.h"
#include "server/job.h"
#include "server/shard_compute.h"

namespace flatshard::server {

// `status` with its message led by "group '<name>': ", unless it names the group
// already: a refusal of a call about many groups says which one it is about.
absl::Status NamingGroup(absl::string_view name, const absl::Status& status);

class Registry {
 public:
  // This server is shard `rank` of `num_servers`. Groups keep their shards in `tier`
  // (server/shard_compute.h) and run CPU kernels on `pool` (null: the caller's thread).
  Registry(int rank, int num_servers, MemoryTier tier = MemoryTier::kHost,
           std::shared_ptr<const ComputePool> pool = nullptr)
      : rank_(rank), num_servers_(num_servers), tier_(tier), pool_(std::move(pool)) {}

  // Creates job `job` or checks that it exists with the same settings
  // (FailedPrecondition naming the difference otherwise). InvalidArgument for W < 1 or
  // a norm type other than 2 or inf, clipping in async mode.
  [[nodiscard]] absl::Status ConfigureJob(const std::string& job, const JobSettings& settings);

  struct Registration {
    std::shared_ptr<Group> group;
    bool created = false;
  };
  // FailedPrecondition if the job is not configured; AlreadyExists if `name` is taken by
  // a different spec; layout and optimizer validation errors as InvalidArgument.
  [[nodiscard]] absl::StatusOr<Registration> RegisterGroup(const std::string& job,
                                                           const std::string& name,
                                                           std::vector<TensorSpec> tensors,
                                                           int64_t align,
                                                           const OptimizerConfig& optimizer);

  struct GroupRequest {
    std::string name;
    std::vector<TensorSpec> tensors;
    int64_t align = 0;
    OptimizerConfig optimizer;
  };
  // The same for several groups of `job`, all or none: a refusal (the errors above, each
  // naming its group as NamingGroup does; InvalidArgument for a name given twice;
  // ResourceExhausted when memory runs out) leaves none of the groups it would have
  // created. The registrations come in `groups`' order. New groups are made outside the
  // lock (their memory takes time while other jobs' requests look groups up) and
  // published together; a group that a racing call published meanwhile is taken if its
  // spec is the same. On the host tier, the small buffers of the groups a call makes
  // (when it makes more than one) share mapped blocks (HostSlab), which stay until the
  // last of those groups lets go.
  [[nodiscard]] absl::StatusOr<std::vector<Registration>> RegisterGroups(const std::string& job,
                                                                         std::vector<GroupRequest> groups);

  // Removes `job` and its groups and closes them (Group::Close, NotFound: their waits end
  // and requests in flight that still hold them are refused). Returns them, in name
  // order. NotFound if the job is not configured.
  [[nodiscard]] absl::StatusOr<std::vector<std::shared_ptr<Group>>> DeleteJob(const std::string& job);
  // The server is shutting down: closes every group with `why` (Unavailable), so that no
  // request waits on one (for a version, a step, a load) past the shutdown's grace, and
  // refuses registrations with it from now on. Idempotent.
  void Stop(const absl::Status& why);

  // NotFound naming the group and job.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Group>> FindGroup(const std::string& job,
                                                                 const std::string& name) const;

  std::vector<std::shared_ptr<Group>> groups() const;
  // The groups of `job`, in name order.
  std::vector<std::shared_ptr<Group>> job_groups(const std::string& job) const;
  // NotFound if the job is not configured.
  [[nodiscard]] absl::StatusOr<JobSettings> job_settings(const std::string& job) const;
  // Every configured job and its settings, in name order.
  std::map<std::string, JobSettings> jobs() const;
  // This server's shard and replica group in `job` (server/job.h); NotFound as above.
  [[nodiscard]] absl::StatusOr<Placement> job_placement(const std::string& job) const;
  int rank() const { return rank_; }
  int num_servers() const { return num_servers_; }

 private:
  const int rank_;
  const int num_servers_;
  const MemoryTier tier_;
  const std::shared_ptr<const ComputePool> pool_;
  mutable absl::Mutex mu_;
  std::map<std::string, JobSettings> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  absl::Status stopped_ ABSL_GUARDED_BY(mu_);  // Stop's reason; OK while serving
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_REGISTRY_H_
