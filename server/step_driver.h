// StepDriver: carries a synchronous step on from a committed contribution, the same way
// on every data plane, including the gradient exchange between the replica groups of a
// hybrid-sharded job (server/job.h).
//
// After Group::CommitScatter a plane calls Continue with the outcome:
//  - kShare (hybrid): sends each chunk of the group's partial for the step to the server
//    that reduces it (Group::ReplicaChunk), then counts the partial
//    (Group::CommitOwnPartial);
//  - kBroadcast (hybrid): sends this server's reduced chunk to the server holding the
//    same shard in every other replica group, then counts it (Group::CommitBroadcast);
//  - kReduced (clipped): hands the step to the ClipCoordinator.
// A partial or reduced chunk that a peer sends here (DataServer, kReplicaPartial and
// kReplicaReduced) is committed with Group::CommitExchange and continues the same way,
// except that a broadcast it triggers runs aside (ContinueAside) once the peer has its
// answer: a handler that sent to peers before answering could deadlock with a peer
// doing the same.
//
// Every message carries its round (Group, ExchangeRound), the load its state comes from
// included. A peer that has committed a load since that state answers Aborted, which the
// contribution that triggered the send gets (this server's own commit of the load drops
// the step); a peer that has not committed the message's load yet waits for its commit
// (BeginExchange).
// When a peer cannot be reached, the contribution that triggered the send is answered
// with Unavailable naming the peer, and the step waits. A worker that sends that
// contribution again finds it held (AlreadyExists): BeginScatter then retries what the
// step still waits for from this server (the partial, the reduced chunk, the norm
// share) to the peers that did not take it, so a step survives a peer that was briefly
// unreachable. A broadcast that runs aside has no worker waiting for it: it retries by
// itself until it is delivered.
//
// The exchange travels on the TCP data plane, one connection per peer opened with a
// session from its OpenSession (the cluster token authenticates it), used by one send at
// a time; the R - 1 sends of a phase go at once.
// A send that fails on a connection that went stale is retried once on a new one; a
// peer that already holds or applied the chunk (AlreadyExists: its answer to an earlier
// send was lost) counts as delivered. exchange_bytes_sent counts each chunk once per
// peer that took it, as the peer's exchange_bytes_received does.
// Thread-safe.
//
//   StepDriver driver(num_servers, clip, connect_to_peer, absl::Seconds(30), stats);
//   FLATSHARD_ASSIGN_OR_RETURN(ReceiveSlot slot, driver.BeginScatter(*group, step, worker, dtype, deadline));
//   ...  // the bytes land in slot.buffer
//   FLATSHARD_RETURN_IF_ERROR(driver.Continue(*group, step, *group->CommitScatter(slot)));
#ifndef FLATSHARD_SERVER_STEP_DRIVER_H_
#define FLATSHARD_SERVER_STEP_DRIVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/clip_coordinator.h"
#include "server/group.h"
#include "server/stats.h"
#include "transport/data_protocol.h"
#include "transport/transport.h"

namespace flatshard::server {

class StepDriver {
 public:
  // Opens an authenticated data connection to server `rank`.
  using Connect = std::function<absl::StatusOr<std::unique_ptr<transport::Connection>>(int rank)>;

  // `timeout`: how long a peer may take to reach the step and take a chunk.
  // `stats` counts the bytes delivered (ServerStats::exchange_bytes_sent).
  StepDriver(int num_servers, ClipCoordinator& clip, Connect connect, absl::Duration timeout,
             ServerStats& stats);
  // Stop(), then waits for what runs aside to finish.
  ~StepDriver();

  // Stops retrying and cuts short the sends in progress (Unavailable to their callers):
  // the server is going away. Later sends fail with Cancelled. Idempotent.
  void Stop();

  // Group::BeginScatter; a contribution to the next step while this server finishes the
  // current one waits for it (Group::AwaitEarlyStep) until `deadline`, the request's (how
  // long its worker waits for the answer), and at most `timeout`. When the contribution
  // is already held (a resend), first sends again what the step still waits for from
  // this server, and returns that failure if it fails again (AlreadyExists otherwise).
  [[nodiscard]] absl::StatusOr<ReceiveSlot> BeginScatter(Group& group, int64_t step, int worker_rank, DType dtype,
                                                         absl::Time deadline, SlotMemory memory = SlotMemory::kHost,
                                                         SlotPart part = {},
                                                         std::optional<uint64_t> from_load = std::nullopt);

  // Group::BeginExchange for a peer's message; one of a load this server has not
  // committed yet waits for that commit, and one of the next step while this server
  // finishes the current one waits for it (Group::AwaitEarlyStep), until `deadline` (the
  // request's) and at most `timeout`.
  [[nodiscard]] absl::StatusOr<ReceiveSlot> BeginExchange(Group& group, Exchange what, const ExchangeRound& round,
                                                          int replica, absl::Time deadline);

  // Continues after `group` committed something for `step` with `outcome` (kShare,
  // kBroadcast: the caller holds the claim, as a commit or ClaimPending handed it over).
  [[nodiscard]] absl::Status Continue(Group& group, int64_t step, CommitOutcome outcome);
  // Continue on a thread of its own. A failure is retried (after 100 ms, doubling up to
  // 2 s) until it succeeds, the step no longer needs it or the driver is destroyed.
  void ContinueAside(std::shared_ptr<Group> group, int64_t step, CommitOutcome outcome);

 private:
  struct Link {
    absl::Mutex mu;  // held for a whole send
    std::unique_ptr<transport::Connection> conn ABSL_GUARDED_BY(mu);
    absl::Mutex active_mu;
    // `conn` while a send is on it, for Stop to cut short.
    transport::Connection* active ABSL_GUARDED_BY(active_mu) = nullptr;
  };
  // One message of the exchange: `bytes` to server `peer`, of replica group `replica`.
  struct Send {
    int replica = 0;
    int peer = 0;
    absl::Span<const std::byte> bytes;
  };
  // kShare and kBroadcast: sends to the peers that do not hold it yet (recording each
  // that takes it: Group::MarkDelivered), then commits; on failure releases the claim
  // (Group::ReleasePending) and returns Unavailable naming the peer (Aborted when the
  // peer refused it as of a state a load replaced).
  absl::StatusOr<CommitOutcome> Deliver(Group& group, int64_t step, CommitOutcome what);
  absl::Status SendTo(const Send& send, transport::DataOp op, const Group& group, const ExchangeRound& round);
  // Sends and sets `verdict` to the peer's answer; returns the transport's error (the
  // connection is then unusable), with `verdict` still set when the peer refused the
  // request before it closed the connection (a chunk too large for it to read and drop).
  absl::Status SendOn(transport::Connection& conn, transport::DataOp op, const Group& group, const ExchangeRound& round,
                      absl::Span<const std::byte> bytes, absl::Status& verdict) const;
  // Sends again what `step` still waits for from this server after a failure: a claim
  // that a failed send released (Group::ClaimPending), or the norm share. False when
  // nothing is left.
  absl::StatusOr<bool> Resume(Group& group, int64_t step);
  void RunAside(std::shared_ptr<Group> group, int64_t step, CommitOutcome outcome);

  ClipCoordinator& clip_;
  ServerStats& stats_;
  const Connect connect_;
  const absl::Duration timeout_;
  std::vector<std::unique_ptr<Link>> links_;  // by rank
  absl::Mutex aside_mu_;
  int aside_running_ ABSL_GUARDED_BY(aside_mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(aside_mu_) = false;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_STEP_DRIVER_H_
