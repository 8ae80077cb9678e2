// The settings of a training job (DESIGN.md, "The training step"): how many workers
// contribute to each step, how contributions are reduced, gradient clipping, the
// asynchronous (parameter-server) mode and hybrid sharding. Plain values.
//
// Hybrid sharding (FSDP's HYBRID_SHARD): the N servers form R replica groups of S = N / R
// consecutive ranks. Every group is laid out over S shards; server r holds shard r % S
// and belongs to replica r / S. Worker w belongs to replica w % R: it gathers from and
// scatters to its replica's servers only. Each server sums its replica's contributions
// (a partial), then all-reduces it with the servers holding the same shard in the other
// replicas (a reduce-scatter and an all-gather: server/group.h, server/step_driver.h),
// adding the R partials in replica order, so every replica computes the same bits and
// steps identically.
#ifndef FLATSHARD_SERVER_JOB_H_
#define FLATSHARD_SERVER_JOB_H_

#include <cstdint>

namespace flatshard::server {

struct JobSettings {
  int num_workers = 1;       // W
  bool reduce_mean = true;   // false: sum
  double max_grad_norm = 0;  // 0: no clipping (sync mode only)
  double norm_type = 2.0;    // 2 or +inf
  bool async = false;        // apply each contribution on arrival
  int64_t max_staleness = -1;  // async: refuse contributions older than this; < 0: no bound
  int replicas = 1;            // R: replica groups (1: plain sharding over every server)
  // Sync mode: a step whose reduced gradient holds inf or NaN is skipped on every server
  // (the version advances; parameters and optimizer state stay), as torch's GradScaler
  // skips optimizer.step().
  bool skip_nonfinite = false;

  bool clipping() const { return max_grad_norm > 0; }
  // Each step's global gradient norm is computed (server/clip_coordinator.h).
  bool needs_norm() const { return clipping() || skip_nonfinite; }
  bool hybrid() const { return replicas > 1; }
  // The replica worker `worker_rank` belongs to.
  int WorkerReplica(int worker_rank) const { return worker_rank % replicas; }
  friend bool operator==(const JobSettings&, const JobSettings&) = default;
};

// Where one server sits in a job: the shard it holds out of the layout's `shards`, and
// its replica group.
struct Placement {
  int shards = 1;   // S: servers per replica group, the layout's world size
  int shard = 0;    // this server's shard index, in [0, S)
  int replica = 0;  // this server's replica group, in [0, R)
  int replicas = 1;

  // Server `rank` of `num_servers` in a job of `replicas` replica groups (a divisor of
  // num_servers, checked by Registry::ConfigureJob).
  static Placement Of(int rank, int num_servers, int replicas) {
    const int shards = num_servers / replicas;
    return Placement{shards, rank % shards, rank / shards, replicas};
  }
  // The rank of the server holding this shard in replica `replica`.
  int PeerRank(int replica_of_peer) const { return replica_of_peer * shards + shard; }
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_JOB_H_
