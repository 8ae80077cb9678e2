// StagedLoads: the checkpoint loads this server has read and verified (PrepareLoad) and
// holds in memory until the client commits or aborts them, each under the id the client
// gave it (the same on every server). A load whose commit does not come within
// `timeout` of its staging or of its client's last renewal (the client renews while other
// servers still prepare; without either, it died between the two phases, or lost its
// connection) is dropped with its memory, by a thread of this class; so are the loads of
// a deleted job. A commit or renewal that finds its load gone says why, for the last
// kRemembered ids dropped.
//
// Thread-safe. Owns the staged buffers; the groups they belong to stay shared with the
// registry. Buffers are freed outside the lock.
//
//   StagedLoads loads(absl::Minutes(10));
//   loads.Add(load_id, "ckpt", "job", std::move(staged));
//   FLATSHARD_ASSIGN_OR_RETURN(StagedGroups groups, loads.Take(load_id, "ckpt"));
#ifndef FLATSHARD_SERVER_STAGED_LOADS_H_
#define FLATSHARD_SERVER_STAGED_LOADS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/checkpoint_loader.h"

namespace flatshard::server {

// One staged load, as GetStatus reports it.
struct StagedLoadRow {
  uint64_t load_id = 0;
  std::string name;  // the checkpoint
  std::string job;
  uint64_t bytes = 0;  // host memory the staged shards hold
  absl::Time staged_at;
  absl::Time expires_at;
};

class StagedLoads {
 public:
  // How many dropped loads' ids are remembered, to say why their commit finds nothing.
  static constexpr size_t kRemembered = 64;

  explicit StagedLoads(absl::Duration timeout);
  ~StagedLoads();  // joins the expiry thread; drops what is still staged
  StagedLoads(const StagedLoads&) = delete;
  StagedLoads& operator=(const StagedLoads&) = delete;

  // Holds `groups` (checkpoint `name` read for `job`) as load `load_id`, replacing a load
  // staged under that id before (a client retrying its preparation).
  void Add(uint64_t load_id, std::string name, std::string job, StagedGroups groups);
  // Hands load `load_id` over for installing. FailedPrecondition when there is none
  // (saying why when it was dropped), or when it stages another checkpoint than `name`.
  [[nodiscard]] absl::StatusOr<StagedGroups> Take(uint64_t load_id, const std::string& name);
  // Holds load `load_id` for another `timeout` from now. FailedPrecondition as Take's.
  [[nodiscard]] absl::Status Renew(uint64_t load_id, const std::string& name);
  // Drops load `load_id`, if staged.
  void Abort(uint64_t load_id);
  // Drops the loads staged for `job`, which was deleted.
  void DropJob(const std::string& job);
  // The loads staged now, by id.
  std::vector<StagedLoadRow> Rows() const;
  absl::Duration timeout() const { return timeout_; }

 private:
  struct Load {
    StagedLoadRow row;
    StagedGroups groups;
  };
  // Moves the loads that `drop` picks out of loads_, remembering `why` for each.
  template <typename Predicate>
  std::vector<StagedGroups> Remove(Predicate drop, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Forget(uint64_t load_id, std::string why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Load `load_id` of checkpoint `name`; FailedPrecondition saying why when there is none
  // (or it stages another checkpoint).
  absl::StatusOr<Load*> Find(uint64_t load_id, const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The expiry thread: drops each load at its expiry, until destruction.
  void ExpireLoads();

  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Load> loads_ ABSL_GUARDED_BY(mu_);
  // Why recently dropped loads went, oldest first (at most kRemembered).
  std::deque<std::pair<uint64_t, std::string>> dropped_ ABSL_GUARDED_BY(mu_);
  bool added_ ABSL_GUARDED_BY(mu_) = false;  // wakes the expiry thread for a new deadline
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expiry_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_STAGED_LOADS_H_
