#include "server/step_driver.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/before_blocking.h"
#include "transport/data_protocol.h"

namespace flatshard::server {

StepDriver::StepDriver(int num_servers, ClipCoordinator& clip, Connect connect, absl::Duration timeout,
                       ServerStats& stats)
    : clip_(clip), stats_(stats), connect_(std::move(connect)), timeout_(timeout) {
  for (int rank = 0; rank < num_servers; ++rank) links_.push_back(std::make_unique<Link>());
}

StepDriver::~StepDriver() {
  Stop();
  absl::MutexLock lock(&aside_mu_);
  aside_mu_.Await(absl::Condition(
      +[](int* running) { return *running == 0; }, &aside_running_));
}

void StepDriver::Stop() {
  {
    absl::MutexLock lock(&aside_mu_);
    stopping_ = true;
  }
  for (const std::unique_ptr<Link>& link : links_) {
    absl::MutexLock lock(&link->active_mu);
    if (link->active != nullptr) link->active->Shutdown();
  }
}

absl::StatusOr<ReceiveSlot> StepDriver::BeginScatter(Group& group, int64_t step, int worker_rank, DType dtype,
                                                     absl::Time deadline, SlotMemory memory, SlotPart part,
                                                     std::optional<uint64_t> from_load) {
  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker_rank, dtype, memory, part, from_load);
  if (absl::IsFailedPrecondition(slot.status())) {
    // The worker may have heard that the step before was accepted before the exchange
    // with the peers finished it here. Wait for it, as long as for a peer at most.
    FLATSHARD_ASSIGN_OR_RETURN(const bool again,
                               group.AwaitEarlyStep(step, std::min(deadline, absl::Now() + timeout_)));
    if (again) slot = group.BeginScatter(step, worker_rank, dtype, memory, part, from_load);
  }
  if (!absl::IsAlreadyExists(slot.status())) return slot;
  // A resend: its first answer may have been a failure to reach a peer.
  FLATSHARD_RETURN_IF_ERROR(Resume(group, step).status());
  return slot;
}

absl::StatusOr<ReceiveSlot> StepDriver::BeginExchange(Group& group, Exchange what, const ExchangeRound& round,
                                                      int replica, absl::Time deadline) {
  // As long as the sender waits for the answer, and as long as for a peer at most.
  deadline = std::min(deadline, absl::Now() + timeout_);
  absl::StatusOr<ReceiveSlot> slot = group.BeginExchange(what, round, replica);
  // The peer committed a checkpoint load that this server is committing too.
  if (absl::IsUnavailable(slot.status()) && group.AwaitLoad(round.load_epoch, deadline)) {
    slot = group.BeginExchange(what, round, replica);
  }
  if (!absl::IsFailedPrecondition(slot.status())) return slot;
  // A peer replica group may be ahead by a step: wait until this one gets there.
  FLATSHARD_ASSIGN_OR_RETURN(const bool again, group.AwaitEarlyStep(round.step, deadline));
  return again ? group.BeginExchange(what, round, replica) : slot;
}

absl::StatusOr<bool> StepDriver::Resume(Group& group, int64_t step) {
  BeforeBlocking();  // what it sends goes to peers
  if (std::optional<CommitOutcome> pending = group.ClaimPending(step)) {
    FLATSHARD_RETURN_IF_ERROR(Continue(group, step, *pending));
    return true;
  }
  if (group.reduced_at(step)) {
    FLATSHARD_RETURN_IF_ERROR(clip_.OnGroupReduced(group.job(), step));
    return true;
  }
  return false;
}

absl::Status StepDriver::Continue(Group& group, int64_t step, CommitOutcome outcome) {
  if (outcome != CommitOutcome::kApplied && outcome != CommitOutcome::kPending) BeforeBlocking();  // peers next
  while (outcome == CommitOutcome::kShare || outcome == CommitOutcome::kBroadcast) {
    FLATSHARD_ASSIGN_OR_RETURN(outcome, Deliver(group, step, outcome));
  }
  if (outcome == CommitOutcome::kReduced) return clip_.OnGroupReduced(group.job(), step);
  return absl::OkStatus();
}

void StepDriver::ContinueAside(std::shared_ptr<Group> group, int64_t step, CommitOutcome outcome) {
  {
    absl::MutexLock lock(&aside_mu_);
    ++aside_running_;
  }
  std::thread([this, group = std::move(group), step, outcome]() mutable {
    RunAside(std::move(group), step, outcome);
  }).detach();
}

void StepDriver::RunAside(std::shared_ptr<Group> group, int64_t step, CommitOutcome outcome) {
  absl::Duration backoff = absl::Milliseconds(100);
  const absl::Status continued = Continue(*group, step, outcome);
  absl::StatusOr<bool> resumed = continued.ok() ? absl::StatusOr<bool>(true) : continued;
  while (!resumed.ok()) {
    {
      absl::MutexLock lock(&aside_mu_);
      if (aside_mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff)) break;
    }
    // Ends when nothing is left to send: another caller (a worker's resend) did it, or
    // a load moved the group on.
    resumed = Resume(*group, step);
    backoff = std::min(2 * backoff, absl::Seconds(2));
  }
  group.reset();  // before the destructor may return
  absl::MutexLock lock(&aside_mu_);
  --aside_running_;
}

absl::StatusOr<CommitOutcome> StepDriver::Deliver(Group& group, int64_t step, CommitOutcome what) {
  const bool share = what == CommitOutcome::kShare;
  const Placement& placement = group.placement();
  FLATSHARD_ASSIGN_OR_RETURN(const OutgoingChunk outgoing,
                             share ? group.SharedPartial(step) : group.BroadcastChunk(step));
  const ExchangeRound& round = outgoing.round;
  // kShare: chunk q of the partial to replica group q's server; kBroadcast: this
  // server's reduced chunk to every other replica group.
  // Peers that took it on an earlier attempt are not sent it again.
  std::vector<Send> sends;
  for (int replica = 0; replica < placement.replicas; ++replica) {
    if (replica == placement.replica || group.Delivered(round, what, replica)) continue;
    absl::Span<const std::byte> part = outgoing.bytes;
    if (share) {
      const auto [offset, numel] = group.ReplicaChunk(replica);
      part = part.subspan(offset * sizeof(float), numel * sizeof(float));
    }
    sends.push_back({replica, placement.PeerRank(replica), part});
  }
  const transport::DataOp op =
      share ? transport::DataOp::kReplicaPartial : transport::DataOp::kReplicaReduced;
  // Every peer at once (each has its own link); this thread sends to the first.
  std::vector<absl::Status> sent(sends.size());
  auto send = [&](size_t i) {
    sent[i] = SendTo(sends[i], op, group, round);
    if (sent[i].ok()) group.MarkDelivered(round, what, sends[i].replica);
  };
  std::vector<std::thread> senders;
  for (size_t i = 1; i < sends.size(); ++i) senders.emplace_back(send, i);
  if (!sends.empty()) send(0);
  for (std::thread& sender : senders) sender.join();
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sent[i].ok()) continue;
    group.ReleasePending(round, what);
    const std::string sent_what =
        absl::StrCat(share ? "partial gradient" : "reduced gradient chunk", " of replica group ", placement.replica,
                     " for group '", group.name(), "' step ", step);
    if (absl::IsAborted(sent[i])) {
      // The peer committed a checkpoint load that replaced this state; so will this
      // server, which drops the step then.
      return absl::AbortedError(
          absl::StrCat("server ", sends[i].peer, " refused the ", sent_what, ": ", sent[i].message()));
    }
    return absl::UnavailableError(absl::StrCat("contribution recorded, but the ", sent_what, " could not reach server ",
                                               sends[i].peer, ": ", sent[i].message(),
                                               "; send the contribution again to retry"));
  }
  return share ? group.CommitOwnPartial(round) : group.CommitBroadcast(round);
}

absl::Status StepDriver::SendTo(const Send& send, transport::DataOp op, const Group& group,
                                const ExchangeRound& round) {
  Link& link = *links_[send.peer];
  absl::MutexLock lock(&link.mu);
  for (int attempt = 0;; ++attempt) {
    const bool reused = link.conn != nullptr;
    if (!reused) {
      FLATSHARD_ASSIGN_OR_RETURN(link.conn, connect_(send.peer));
    }
    {
      absl::MutexLock active_lock(&link.active_mu);
      absl::MutexLock stopping_lock(&aside_mu_);
      if (stopping_) return absl::CancelledError("this server is shutting down");
      link.active = link.conn.get();
    }
    absl::Status verdict;
    const absl::Status transported = SendOn(*link.conn, op, group, round, send.bytes, verdict);
    {
      absl::MutexLock active_lock(&link.active_mu);
      link.active = nullptr;
    }
    if (!transported.ok()) link.conn.reset();  // unusable
    if (transported.ok() || !verdict.ok()) {
      // Held or applied already: its answer to an earlier send was lost (peers that
      // answered are not sent it again), so it is counted now, as the receiver counted
      // it when it took it.
      const bool delivered = verdict.ok() || absl::IsAlreadyExists(verdict);
      if (delivered) stats_.exchange_bytes_sent += static_cast<int64_t>(send.bytes.size());
      return delivered ? absl::OkStatus() : verdict;
    }
    // No answer: an idle connection may just have gone stale, so one more try.
    if (!reused || attempt > 0) return transported;
  }
}

absl::Status StepDriver::SendOn(transport::Connection& conn, transport::DataOp op, const Group& group,
                                const ExchangeRound& round, absl::Span<const std::byte> bytes,
                                absl::Status& verdict) const {
  transport::RequestHeader header;
  header.op = static_cast<uint8_t>(op);
  header.dtype = static_cast<uint8_t>(DType::kFloat32);
  header.worker_rank = group.placement().replica;
  header.version = round.step;
  header.timeout_ms = absl::ToInt64Milliseconds(timeout_);
  header.flags = transport::kRequestLoadKnown;
  header.load_id = round.load_epoch;
  if (absl::Status sent = transport::SendRequest(conn, header, group.job(), group.name(), bytes); !sent.ok()) {
    absl::StatusOr<transport::Response> refused = transport::AnswerToFailedSend(conn, sent);
    if (refused.ok()) verdict = refused->status;
    return sent;
  }
  FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(conn, {}));
  verdict = response.status;
  return absl::OkStatus();
}

}  // namespace flatshard::server
