#include "server/step_driver.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/data_protocol.h"

namespace flatshard::server {

StepDriver::StepDriver(int num_servers, ClipCoordinator& clip, Connect connect, absl::Duration timeout)
    : clip_(clip), connect_(std::move(connect)), timeout_(timeout) {
  for (int rank = 0; rank < num_servers; ++rank) links_.push_back(std::make_unique<Link>());
}

absl::StatusOr<ReceiveSlot> StepDriver::BeginScatter(Group& group, int64_t step, int worker_rank,
                                                     DType dtype, SlotMemory memory) {
  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker_rank, dtype, memory);
  if (!absl::IsAlreadyExists(slot.status())) return slot;
  // A resend: its first answer may have been a failure to reach a peer.
  if (group.ClaimShare(step)) {
    FLATSHARD_RETURN_IF_ERROR(Continue(group, step, CommitOutcome::kShare));
  } else if (group.reduced_at(step)) {
    FLATSHARD_RETURN_IF_ERROR(clip_.OnGroupReduced(group.job(), step));
  }
  return slot;
}

absl::Status StepDriver::Continue(Group& group, int64_t step, CommitOutcome outcome) {
  if (outcome == CommitOutcome::kShare) {
    FLATSHARD_ASSIGN_OR_RETURN(outcome, SharePartial(group, step));
  }
  if (outcome == CommitOutcome::kReduced) return clip_.OnGroupReduced(group.job(), step);
  return absl::OkStatus();
}

absl::StatusOr<CommitOutcome> StepDriver::SharePartial(Group& group, int64_t step) {
  FLATSHARD_ASSIGN_OR_RETURN(const absl::Span<const std::byte> partial, group.SharedPartial(step));
  const Placement& placement = group.placement();
  std::vector<int> peers;
  for (int replica = 0; replica < placement.replicas; ++replica) {
    if (replica != placement.replica) peers.push_back(placement.PeerRank(replica));
  }
  // Every peer at once (each has its own link); this thread sends to the first.
  std::vector<absl::Status> sent(peers.size());
  std::vector<std::thread> senders;
  for (size_t i = 1; i < peers.size(); ++i) {
    senders.emplace_back([&, i] { sent[i] = SendPartial(peers[i], group, step, partial); });
  }
  sent[0] = SendPartial(peers[0], group, step, partial);
  for (std::thread& sender : senders) sender.join();
  for (size_t i = 0; i < peers.size(); ++i) {
    if (sent[i].ok()) continue;
    group.ReleaseShare(step);
    return absl::UnavailableError(absl::StrCat(
        "contribution recorded, but the partial gradient of replica group ", placement.replica,
        " for group '", group.name(), "' step ", step, " could not reach server ", peers[i], ": ",
        sent[i].message(), "; send the contribution again to retry"));
  }
  return group.CommitOwnPartial(step);
}

absl::Status StepDriver::SendPartial(int peer, const Group& group, int64_t step,
                                     absl::Span<const std::byte> partial) {
  Link& link = *links_[peer];
  absl::MutexLock lock(&link.mu);
  for (int attempt = 0;; ++attempt) {
    const bool reused = link.conn != nullptr;
    if (!reused) {
      FLATSHARD_ASSIGN_OR_RETURN(link.conn, connect_(peer));
    }
    absl::Status verdict;
    const absl::Status transported = SendOn(*link.conn, group, step, partial, verdict);
    if (transported.ok()) {
      // Held or applied already (a resend after a lost answer): delivered.
      return absl::IsAlreadyExists(verdict) ? absl::OkStatus() : verdict;
    }
    // The connection is unusable; an idle one may just have gone stale: one more try.
    link.conn.reset();
    if (!reused || attempt > 0) return transported;
  }
}

absl::Status StepDriver::SendOn(transport::Connection& conn, const Group& group, int64_t step,
                                absl::Span<const std::byte> partial, absl::Status& verdict) const {
  transport::RequestHeader header;
  header.op = static_cast<uint8_t>(transport::DataOp::kReplicaPartial);
  header.dtype = static_cast<uint8_t>(DType::kFloat32);
  header.worker_rank = group.placement().replica;
  header.version = step;
  header.timeout_ms = absl::ToInt64Milliseconds(timeout_);
  FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(conn, header, group.job(), group.name(), partial));
  FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(conn, {}));
  verdict = response.status;
  return absl::OkStatus();
}

}  // namespace flatshard::server
