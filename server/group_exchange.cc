// Group's side of a hybrid-sharded job's exchange between replica groups (group.h, "the
// exchange"): the chunks, this replica's partial and reduced chunk to send, what peers
// send here, and the sums once every replica group's part is in.
#include "server/group.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"
#include "server/before_blocking.h"

namespace flatshard::server {

std::pair<int64_t, int64_t> Group::ReplicaChunk(int replica) const {
  return flatshard::ReplicaChunk(shard_numel(), job_settings_.replicas, replica);
}

absl::Status Group::CheckOutgoing(Exchange what, const ExchangeRound& round) const {
  const std::vector<SlotState>& states = what == Exchange::kPartial ? partial_states_ : reduced_states_;
  if (job_settings_.hybrid() && InRound(round) && states[placement_.replica] == SlotState::kReceiving) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("group '", name_, "' has no ", what == Exchange::kPartial ? "partial" : "reduced chunk",
                   " of replica group ", placement_.replica, " waiting to be sent for step ", round.step, " of ",
                   LoadedState(round.load_epoch), " (at version ", version_, " of ", LoadedState(load_epoch_), ")"));
}

absl::StatusOr<OutgoingChunk> Group::SharedPartial(int64_t step) const {
  absl::MutexLock lock(&mu_);
  const ExchangeRound round{step, load_epoch_};
  FLATSHARD_RETURN_IF_ERROR(CheckOutgoing(Exchange::kPartial, round));
  return OutgoingChunk{round, own_partial_.bytes().subspan(0, static_cast<size_t>(shard_numel()) * sizeof(float))};
}

absl::StatusOr<CommitOutcome> Group::CommitOwnPartial(const ExchangeRound& round) {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(CheckOutgoing(Exchange::kPartial, round));
  partial_states_[placement_.replica] = SlotState::kReady;
  share_claimed_ = false;
  return PartialArrived(placement_.replica);
}

absl::StatusOr<OutgoingChunk> Group::BroadcastChunk(int64_t step) const {
  absl::MutexLock lock(&mu_);
  const ExchangeRound round{step, load_epoch_};
  FLATSHARD_RETURN_IF_ERROR(CheckOutgoing(Exchange::kReduced, round));
  const auto [offset, numel] = ReplicaChunk(placement_.replica);
  return OutgoingChunk{round, ReducedGradient().subspan(offset * sizeof(float), numel * sizeof(float))};
}

absl::StatusOr<CommitOutcome> Group::CommitBroadcast(const ExchangeRound& round) {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(CheckOutgoing(Exchange::kReduced, round));
  reduced_states_[placement_.replica] = SlotState::kReady;
  broadcast_claimed_ = false;
  return ReducedArrived(placement_.replica);
}

void Group::ReleasePending(const ExchangeRound& round, CommitOutcome what) {
  absl::MutexLock lock(&mu_);
  if (!InRound(round)) return;
  (what == CommitOutcome::kShare ? share_claimed_ : broadcast_claimed_) = false;
}

void Group::MarkDelivered(const ExchangeRound& round, CommitOutcome what, int replica) {
  absl::MutexLock lock(&mu_);
  std::vector<bool>& delivered = what == CommitOutcome::kShare ? share_delivered_ : broadcast_delivered_;
  if (InRound(round) && replica >= 0 && replica < static_cast<int>(delivered.size())) delivered[replica] = true;
}

bool Group::Delivered(const ExchangeRound& round, CommitOutcome what, int replica) const {
  absl::MutexLock lock(&mu_);
  const std::vector<bool>& delivered = what == CommitOutcome::kShare ? share_delivered_ : broadcast_delivered_;
  return InRound(round) && replica >= 0 && replica < static_cast<int>(delivered.size()) && delivered[replica];
}

std::optional<CommitOutcome> Group::ClaimPending(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (!job_settings_.hybrid() || version_ != step) return std::nullopt;
  if (!share_claimed_ && partial_states_[placement_.replica] == SlotState::kReceiving) {
    share_claimed_ = true;
    return CommitOutcome::kShare;
  }
  if (!broadcast_claimed_ && reduced_states_[placement_.replica] == SlotState::kReceiving) {
    broadcast_claimed_ = true;
    return CommitOutcome::kBroadcast;
  }
  return std::nullopt;
}

absl::StatusOr<ReceiveSlot> Group::BeginExchange(Exchange what, const ExchangeRound& round, int replica) {
  const char* noun = what == Exchange::kPartial ? "partial" : "reduced chunk";
  if (!job_settings_.hybrid() || replica < 0 || replica >= job_settings_.replicas ||
      replica == placement_.replica) {
    return absl::InvalidArgumentError(absl::StrCat(
        noun, " from replica group ", replica, " for group '", name_, "' of job '", job_,
        "': this server is in replica group ", placement_.replica, " of ",
        job_settings_.replicas, " and takes them from the others only"));
  }
  if (frozen_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group '", name_, "' of job '", job_, "' is frozen: it takes no ", noun, "s"));
  }
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(CheckOpen());
  const int64_t step = round.step;
  if (round.load_epoch != load_epoch_) {
    if (left_load_epochs_.contains(round.load_epoch)) {
      return absl::AbortedError(absl::StrCat(
          noun, " of replica group ", replica, " for group '", name_, "' step ", step, " is of ",
          LoadedState(round.load_epoch), ", which a checkpoint load replaced here (this server holds ",
          LoadedState(load_epoch_), " at version ", version_, "); the step is taken again from the loaded state"));
    }
    return absl::UnavailableError(absl::StrCat(noun, " of replica group ", replica, " for group '", name_, "' step ",
                                               step, " is of ", LoadedState(round.load_epoch),
                                               ", which this server has not committed yet (it holds ",
                                               LoadedState(load_epoch_), " at version ", version_, ")"));
  }
  if (step < version_) {
    return absl::AlreadyExistsError(absl::StrCat(
        noun, " of replica group ", replica, " for group '", name_, "': step ", step,
        " was already applied; this server is at version ", version_));
  }
  if (step > version_) {
    return absl::FailedPreconditionError(absl::StrCat(
        noun, " of replica group ", replica, " for group '", name_, "' for step ", step,
        " before step ", version_, " is complete"));
  }
  std::vector<SlotState>& states = ExchangeStates(what);
  switch (states[replica]) {
    case SlotState::kReady:
      return absl::AlreadyExistsError(absl::StrCat("duplicate ", noun, " of replica group ", replica,
                                                   " for group '", name_, "' step ", step));
    case SlotState::kReceiving:
      return absl::FailedPreconditionError(absl::StrCat("the ", noun, " of replica group ", replica,
                                                        " for group '", name_, "' step ", step,
                                                        " is already being received"));
    case SlotState::kEmpty:
      break;
  }
  // A partial of this server's chunk lands in its own buffer; a reduced chunk in its
  // place in the reduced gradient.
  const auto [offset, numel] = ExchangeChunk(what, replica);
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  absl::Span<std::byte> buffer;
  if (what == Exchange::kPartial) {
    FLATSHARD_RETURN_IF_ERROR(EnsureStaging(partial_chunks_[replica], bytes,
                                            absl::StrCat("partial of replica group ", replica)));
    buffer = partial_chunks_[replica].bytes().subspan(0, bytes);
  } else {
    FLATSHARD_RETURN_IF_ERROR(EnsureReducedGradient());
    buffer = ReducedGradient().subspan(offset * sizeof(float), bytes);
  }
  states[replica] = SlotState::kReceiving;
  return ReceiveSlot{step, replica, DType::kFloat32, buffer, {}, load_epoch_};
}

absl::StatusOr<CommitOutcome> Group::CommitExchange(Exchange what, const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  std::vector<SlotState>& states = ExchangeStates(what);
  if (!InRound({slot.step, slot.load_epoch}) || states[slot.worker_rank] != SlotState::kReceiving) {
    return absl::AbortedError(absl::StrCat(
        "group '", name_, "' was loaded or re-initialized while the ",
        what == Exchange::kPartial ? "partial" : "reduced chunk", " of replica group ",
        slot.worker_rank, " was received"));
  }
  states[slot.worker_rank] = SlotState::kReady;
  return what == Exchange::kPartial ? PartialArrived(slot.worker_rank) : ReducedArrived(slot.worker_rank);
}

void Group::AbortExchange(Exchange what, const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  std::vector<SlotState>& states = ExchangeStates(what);
  if (InRound({slot.step, slot.load_epoch}) && states[slot.worker_rank] == SlotState::kReceiving) {
    states[slot.worker_rank] = SlotState::kEmpty;
  }
}

bool Group::AwaitLoad(uint64_t load_epoch, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto committed = [this, load_epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return load_epoch_ == load_epoch || left_load_epochs_.contains(load_epoch) || !closed_.ok();
  };
  return AwaitBlocking(mu_, absl::Condition(&committed), deadline);
}

absl::Status Group::EnsureReducedGradient() {
  if (compute_->tier() != MemoryTier::kDevice) return absl::OkStatus();
  return EnsureStaging(reduced_staging_, static_cast<size_t>(shard_numel()) * sizeof(float),
                       "reduced gradient");
}

absl::Span<std::byte> Group::ReducedGradient() const {
  const ShardBuffer& buffer = compute_->tier() != MemoryTier::kDevice ? grad_ : reduced_staging_;
  return buffer.bytes().subspan(0, static_cast<size_t>(shard_numel()) * sizeof(float));
}

bool Group::AllReady(const std::vector<SlotState>& states) {
  return std::all_of(states.begin(), states.end(),
                     [](SlotState state) { return state == SlotState::kReady; });
}

absl::StatusOr<CommitOutcome> Group::PartialArrived(int replica) {
  if (!AllReady(partial_states_)) return CommitOutcome::kPending;
  // Replica order: the owner of a chunk adds the same partials in the same order as the
  // whole-shard sum would, and every replica group receives the owner's bits.
  const auto [offset, numel] = ReplicaChunk(placement_.replica);
  absl::Status reduced = EnsureReducedGradient();
  if (reduced.ok() && numel > 0) {
    std::vector<kernels::Contribution> partials;
    for (int q = 0; q < job_settings_.replicas; ++q) {
      const float* chunk = q == placement_.replica ? own_partial_.floats() + offset : partial_chunks_[q].floats();
      partials.push_back({DType::kFloat32, chunk});
    }
    float* out = reinterpret_cast<float*>(ReducedGradient().data()) + offset;
    reduced = compute_->Reduce(partials, out, numel, ReduceAlpha());
    if (reduced.ok()) reduced = compute_->Synchronize();
  }
  if (!reduced.ok()) {
    // A kernel failed: nothing was applied. The partial that arrived last is taken back,
    // so that sending it again (a peer's resend, or this replica group's share claimed
    // again on a worker's resend) retries the sum.
    partial_states_[replica] = replica == placement_.replica ? SlotState::kReceiving : SlotState::kEmpty;
    return reduced;
  }
  reduced_states_[placement_.replica] = SlotState::kReceiving;
  broadcast_claimed_ = true;
  return CommitOutcome::kBroadcast;
}

absl::StatusOr<CommitOutcome> Group::ReducedArrived(int replica) {
  if (!AllReady(reduced_states_)) return CommitOutcome::kPending;
  absl::Status copied = absl::OkStatus();
  if (compute_->tier() == MemoryTier::kDevice) {
    copied = compute_->CopyFromHost(reduced_staging_.floats(), grad_.floats(), shard_numel());
  }
  if (copied.ok()) copied = ZeroGradientPadding();
  if (copied.ok()) copied = compute_->Synchronize();
  if (!copied.ok()) {
    // As in PartialArrived: the chunk that arrived last is taken back.
    reduced_states_[replica] = replica == placement_.replica ? SlotState::kReceiving : SlotState::kEmpty;
    return copied;
  }
  return FinishReduction();
}

absl::Status Group::ReduceOwnPartial() {
  std::vector<kernels::Contribution> contributions;
  for (int worker = 0; worker < job_settings_.num_workers; ++worker) {
    if (job_settings_.WorkerReplica(worker) != placement_.replica) continue;
    contributions.push_back({contributions_[worker].dtype, contributions_[worker].data});
  }
  const size_t bytes = static_cast<size_t>(shard_numel()) * sizeof(float);
  FLATSHARD_RETURN_IF_ERROR(EnsureStaging(
      own_partial_, bytes, absl::StrCat("partial of replica group ", placement_.replica)));
  FLATSHARD_RETURN_IF_ERROR(compute_->Reduce(contributions, own_partial_.floats(), shard_numel(), 1.0f));
  FLATSHARD_RETURN_IF_ERROR(compute_->Synchronize());
  partial_states_[placement_.replica] = SlotState::kReceiving;
  return absl::OkStatus();
}

void Group::ResetExchange() {
  std::fill(partial_states_.begin(), partial_states_.end(), SlotState::kEmpty);
  std::fill(reduced_states_.begin(), reduced_states_.end(), SlotState::kEmpty);
  share_claimed_ = false;
  broadcast_claimed_ = false;
  std::fill(share_delivered_.begin(), share_delivered_.end(), false);
  std::fill(broadcast_delivered_.begin(), broadcast_delivered_.end(), false);
}

}  // namespace flatshard::server
