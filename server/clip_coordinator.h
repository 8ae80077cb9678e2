// ClipCoordinator: gradient clipping by global norm (torch.nn.utils.clip_grad_norm_ on the
// reduced gradient) over every group of a job and every server of the cluster, and the
// skipping of steps whose norm is inf or NaN (JobSettings::skip_nonfinite: every server
// sees the same norm, so all skip together).
//
// When all groups of a clipped job that are at version `step` (frozen ones aside: they
// take no gradients) have reduced their contributions on this server, the server computes
// its share of the norm (sum of squares over its shards, in group-name order, for
// norm_type 2; max |g| for inf), sends it to every peer and records it. Once the shares of
// all N servers are in, each server combines them in rank order (so every server computes
// the same bits), derives clip_coef = max_norm / (total_norm + 1e-6) and finishes the step
// of every such group: scale by clip_coef when it is below 1, optimizer step, version + 1.
// The groups of the job thus step together, and the norm stays readable (TotalNorm) for
// logging, as clip_grad_norm_'s return value is. In a hybrid-sharded job (server/job.h) every
// replica group holds the same reduced gradient, so "every peer" and "all N servers" are
// the S servers of this server's replica group, combined in shard order.
//
// A checkpoint load (OnLoad) rewinds a job's versions, so the shares of the steps in
// progress, computed from the state it replaced, must not count for the steps taken again
// from the loaded one. Every share carries the epoch of its sender's job: the id of the
// load its state follows, the same on every server (the client picks it), 0 before any.
// A share of an epoch this server has left is ignored; one of an epoch it has not reached
// yet (its sender committed the load first) is refused with Unavailable, which the sender
// retries until this server commits the load too. (A server restarted since the last load
// is at epoch 0 until the next one; its job needs that load anyway: its groups start
// afresh.)
//
// Thread-safe. Lock order: this coordinator, then a Group; never the reverse.
//
//   ClipCoordinator clip(registry, rank, num_servers, send_to_peer);
//   if (outcome == CommitOutcome::kReduced) status = clip.OnGroupReduced(job, step);
#ifndef FLATSHARD_SERVER_CLIP_COORDINATOR_H_
#define FLATSHARD_SERVER_CLIP_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/caller_wait.h"
#include "server/registry.h"

namespace flatshard::server {

class ClipCoordinator {
 public:
  // Delivers this server's share, of the job's `epoch`, to peer `rank`; blocks until
  // delivered or given up.
  using SendPartial =
      std::function<absl::Status(int rank, const std::string& job, int64_t step, double partial, uint64_t epoch)>;

  ClipCoordinator(Registry& registry, int rank, int num_servers, SendPartial send);

  // Called after a group of `job` reduced its contributions for `step`. When it was the
  // last such group on this server, shares the partial norm (blocking on the peers).
  // Returns Unavailable naming the peer if a share could not be delivered; calling it
  // again then sends the share again (peers ignore a share they already hold).
  [[nodiscard]] absl::Status OnGroupReduced(const std::string& job, int64_t step);

  // A server's share for (job, step), of the job's `epoch` there; the last one finishes
  // the step here. A second share from the same rank is ignored, and so is one of an
  // epoch this server has left; Unavailable for one of an epoch it has not reached yet.
  // InvalidArgument for a rank outside the cluster or this server's replica group, or a
  // job that computes no norm.
  [[nodiscard]] absl::Status RecordPartial(const std::string& job, int64_t step, int rank, double partial,
                                           uint64_t epoch);

  // The total gradient norm of `job` at `step`, before clipping (what
  // torch.nn.utils.clip_grad_norm_ returns), once this server has combined it; waits
  // until `deadline`. The norms of a job's last kKeptNorms steps are kept.
  // InvalidArgument for a job that computes no norm, NotFound for a step applied here whose
  // norm is not kept (older, or from before a restart or a load), DeadlineExceeded; Stop's
  // reason once the server is shutting down; Cancelled once `caller_gone` (optional,
  // server/caller_wait.h) says the caller went away.
  static constexpr size_t kKeptNorms = 1024;
  [[nodiscard]] absl::StatusOr<double> TotalNorm(const std::string& job, int64_t step, absl::Time deadline,
                                                 const CallerGone& caller_gone = nullptr);
  // Checkpoint load `load_id` (non-zero, the same on every server) rewound the versions
  // of `job`: its kept norms and the shares of its steps in progress are dropped, and its
  // epoch becomes `load_id`.
  void OnLoad(const std::string& job, uint64_t load_id);

  // `job` was deleted: its norms, shares and epochs go, and waits for its norms end with
  // NotFound. A job configured again under the name starts afresh.
  void ForgetJob(const std::string& job);
  // The server is shutting down: waits for a norm end with `why` (Unavailable), and
  // later ones too, rather than wait past the shutdown's grace.
  void Stop(const absl::Status& why);

  // For status: the last step whose norm this server combined, that norm, and how many
  // steps it skipped as non-finite (since it started).
  struct JobNorms {
    int64_t last_step = -1;  // none yet
    double last_norm = 0;
    int64_t skipped_steps = 0;
  };
  JobNorms Norms(const std::string& job);

 private:
  struct StepState {
    std::vector<std::optional<double>> partials;
    int received = 0;
    bool shared = false;  // this server's share was computed and sent
  };

  StepState& State(const std::string& job, int64_t step, const Placement& placement)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Registry& registry_;
  const int rank_;
  const int num_servers_;
  const SendPartial send_;
  absl::Mutex mu_;
  std::map<std::pair<std::string, int64_t>, StepState> steps_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<int64_t, double>> norms_ ABSL_GUARDED_BY(mu_);  // job -> step -> norm
  std::map<std::string, int64_t> skipped_steps_ ABSL_GUARDED_BY(mu_);  // job -> count
  std::map<std::string, uint64_t> epochs_ ABSL_GUARDED_BY(mu_);        // job -> its load id (0: none)
  std::map<std::string, std::set<uint64_t>> left_epochs_ ABSL_GUARDED_BY(mu_);  // job -> epochs before
  absl::Status stopped_ ABSL_GUARDED_BY(mu_);                                   // Stop's reason; OK while serving
  std::map<std::string, int64_t> deletions_ ABSL_GUARDED_BY(mu_);               // job -> ForgetJob calls
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CLIP_COORDINATOR_H_
