// NcclPlane: the server side of the NCCL data plane, for workers whose buffers are on
// another GPU or node than this --memory=device server's shards.
//
// A worker opens a channel with the OpenNcclChannel RPC: it sends an ncclUniqueId it
// made, and this server joins that 2-rank communicator as rank 0 in the background
// (the worker joins as rank 1). The worker then sends kNcclGather / kNcclScatter
// requests on its data connections; DataServer answers each twice, around the
// transfer:
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto transfer, plane.Begin(request, target));  // "ready"
//   FLATSHARD_ASSIGN_OR_RETURN(StateStamp state, plane.Finish(transfer));     // "done"
//
// A gather stages the shard in the gather dtype (the version stays whole while it is
// sent) and sends it; a scatter receives into the worker's device staging slot and
// commits it (exactly-once, versions, clipping and hybrid sharding as on the other
// planes). Each channel has its own CUDA stream and moves one transfer at a time, in
// request order. A transfer that fails or outlasts `timeout` (a dead worker), or whose
// worker gave it up (closed its connection), aborts that channel's communicator and
// closes the channel; the worker opens another, and every other channel keeps serving.
// Off (every call FailedPrecondition) in a build without CUDA, on a server whose memory
// is not the device, or where NCCL does not load.
// Thread-safe.
#ifndef FLATSHARD_SERVER_NCCL_PLANE_H_
#define FLATSHARD_SERVER_NCCL_PLANE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/caller_wait.h"
#include "server/registry.h"
#include "server/shard_compute.h"
#include "server/stats.h"
#include "server/step_driver.h"
#include "transport/data_protocol.h"

namespace flatshard::server {

class NcclPlane {
 public:
  // `timeout` bounds a channel's join and each transfer's wait for the worker.
  NcclPlane(Registry& registry, StepDriver& driver, ServerStats& stats, absl::Duration timeout);
  ~NcclPlane();  // closes every channel, ending the joins in progress

  // Turns the plane on when `tier` is the device and NCCL loads; otherwise it stays off
  // (not an error: workers then use another plane).
  [[nodiscard]] absl::Status Start(MemoryTier tier);
  // NCCL's version ("2.28.9") when the plane is on, empty when it is off.
  const std::string& version() const { return version_; }

  // Starts joining communicator `unique_id` (128 bytes) as rank 0 of 2 and returns the
  // channel's id. InvalidArgument for a malformed id.
  [[nodiscard]] absl::StatusOr<uint64_t> Open(const std::string& unique_id, int worker_rank);

  // A kNcclGather or kNcclScatter request between its two answers. Dropped without
  // Finish (the ready answer could not be sent), it gives back what Begin took.
  class Transfer;
  // Checks `request` and `target` and readies the bytes: waits for the channel's join
  // and its previous transfer, then (gather) stages the shard at a version >=
  // min_version or (scatter) takes the worker's slot, checking the load the gradient was
  // computed from. The state is the ready answer's (a gather's: the staged one). A
  // gather's wait for its version ends Cancelled once `caller_gone` says the worker went.
  [[nodiscard]] absl::StatusOr<std::pair<std::shared_ptr<Transfer>, StateStamp>> Begin(
      const transport::Request& request, const transport::NcclTarget& target, const CallerGone& caller_gone = nullptr);
  // Moves the bytes and commits a scatter; returns the done answer's state. Ends
  // Cancelled, the channel closed, once `caller_gone` (asked every 0.1 s) says the
  // worker gave the request up: its NCCL will not do its half, and the wait would
  // otherwise last `timeout`. Dropping the transfer then gives a scatter's slot back.
  [[nodiscard]] absl::StatusOr<StateStamp> Finish(const std::shared_ptr<Transfer>& transfer,
                                                  const CallerGone& caller_gone = nullptr);

 private:
  struct State;  // channels, in CUDA builds

  Registry& registry_;
  StepDriver& driver_;
  ServerStats& stats_;
  const absl::Duration timeout_;
  std::string version_;
  std::unique_ptr<State> state_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_NCCL_PLANE_H_
