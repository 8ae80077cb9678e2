#include "server/replica_exchange.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/data_protocol.h"

namespace flatshard::server {

ReplicaExchange::ReplicaExchange(int num_servers, ClipCoordinator& clip, Connect connect,
                                 absl::Duration timeout)
    : clip_(clip), connect_(std::move(connect)), timeout_(timeout) {
  for (int rank = 0; rank < num_servers; ++rank) links_.push_back(std::make_unique<Link>());
}

absl::Status ReplicaExchange::Continue(Group& group, int64_t step, CommitOutcome outcome) {
  if (outcome == CommitOutcome::kShare) {
    FLATSHARD_ASSIGN_OR_RETURN(const absl::Span<const std::byte> partial, group.SharedPartial(step));
    const Placement& placement = group.placement();
    for (int replica = 0; replica < placement.replicas; ++replica) {
      if (replica == placement.replica) continue;
      const int peer = placement.PeerRank(replica);
      if (absl::Status sent = SendPartial(peer, group, step, partial); !sent.ok()) {
        return absl::UnavailableError(absl::StrCat(
            "contribution recorded, but the partial gradient of replica group ", placement.replica,
            " for group '", group.name(), "' step ", step, " could not reach server ", peer, ": ",
            sent.message()));
      }
    }
    FLATSHARD_ASSIGN_OR_RETURN(outcome, group.CommitOwnPartial(step));
  }
  if (outcome == CommitOutcome::kReduced) return clip_.OnGroupReduced(group.job(), step);
  return absl::OkStatus();
}

absl::Status ReplicaExchange::SendPartial(int peer, const Group& group, int64_t step,
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

absl::Status ReplicaExchange::SendOn(transport::Connection& conn, const Group& group, int64_t step,
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
