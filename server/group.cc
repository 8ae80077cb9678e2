#include "server/group.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/huge_pages.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"
#include "server/before_blocking.h"
#include "server/snapshot_pool.h"
#include "transport/data_protocol.h"

namespace flatshard::server {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(absl::string_view text) {
  uint64_t hash = 0xCBF29CE484222325ull;
  for (char c : text) hash = (hash ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return hash;
}

// torch.nn.Linear-style bound: 1/sqrt(fan_in), fan_in = numel / shape[0] for >= 2 dims.
float InitBound(const TensorSpec& spec, int64_t numel) {
  int64_t fan_in = numel;
  if (spec.shape.size() >= 2 && spec.shape[0] > 0) fan_in = numel / spec.shape[0];
  return fan_in > 0 ? 1.0f / std::sqrt(static_cast<float>(fan_in)) : 1.0f;
}

int DTypeIndex(DType dtype) { return static_cast<int>(dtype); }

// The workers of `settings` in replica group `replica` (all W without hybrid sharding).
int ReplicaWorkers(const JobSettings& settings, int replica) {
  int count = 0;
  for (int worker = 0; worker < settings.num_workers; ++worker) {
    count += settings.WorkerReplica(worker) == replica ? 1 : 0;
  }
  return count;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Group>> Group::Create(std::string job, std::string name,
                                                     FlatLayout layout, Placement placement,
                                                     JobSettings job_settings,
                                                     OptimizerConfig optimizer, MemoryTier tier,
                                                     std::shared_ptr<const ComputePool> pool,
                                                     HostSlab* small_buffers) {
  if (IsAverage(optimizer) && job_settings.async) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", name, "': optimizer average (module buffers) needs a SYNC job; job '", job, "' is ASYNC"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<ShardCompute> compute,
                             MakeShardCompute(tier, std::move(pool)));
  if (tier != MemoryTier::kHost) small_buffers = nullptr;
  auto allocate = [&](size_t bytes, absl::string_view what) -> absl::StatusOr<ShardBuffer> {
    if (small_buffers != nullptr && HostSlab::Carves(bytes)) return small_buffers->Allocate(bytes, what);  // zeroed
    return compute->AllocateShard(bytes, what);
  };
  const std::string what = absl::StrCat("group '", name, "'");
  const size_t bytes = static_cast<size_t>(layout.shard_numel()) * sizeof(float);
  FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer params, allocate(bytes, absl::StrCat(what, " parameters")));
  ShardBuffer grad;  // a frozen group takes no gradients
  if (!IsFrozen(optimizer)) {
    FLATSHARD_ASSIGN_OR_RETURN(grad, allocate(bytes, absl::StrCat(what, " gradient")));
  }
  FLATSHARD_ASSIGN_OR_RETURN(
      ShardOptimizer shard_optimizer,
      ShardOptimizer::Create(std::move(optimizer), layout.shard_numel(), *compute,
                             absl::StrCat(what, " optimizer state"), allocate));
  return std::shared_ptr<Group>(new Group(std::move(job), std::move(name), std::move(layout), placement,
                                          job_settings, std::move(compute), std::move(params),
                                          std::move(grad), std::move(shard_optimizer)));
}

Group::Group(std::string job, std::string name, FlatLayout layout, Placement placement,
             JobSettings job_settings, std::unique_ptr<ShardCompute> compute, ShardBuffer params,
             ShardBuffer grad, ShardOptimizer optimizer)
    : job_(std::move(job)),
      name_(std::move(name)),
      layout_(std::move(layout)),
      placement_(placement),
      job_settings_(job_settings),
      replica_workers_(ReplicaWorkers(job_settings, placement.replica)),
      padding_runs_(layout_.ShardPaddingRuns(placement.shard)),
      compute_(std::move(compute)),
      params_(std::move(params)),
      grad_(std::move(grad)),
      optimizer_(std::move(optimizer)),
      frozen_(IsFrozen(optimizer_.config())),
      average_(IsAverage(optimizer_.config())),
      contributions_(job_settings.num_workers),
      staging_(job_settings.num_workers),
      device_staging_(job_settings.num_workers),
      snapshot_pool_(std::make_shared<SnapshotPool>()),
      partial_states_(job_settings.hybrid() ? job_settings.replicas : 0, SlotState::kEmpty),
      reduced_states_(job_settings.hybrid() ? job_settings.replicas : 0, SlotState::kEmpty),
      partial_chunks_(job_settings.hybrid() ? job_settings.replicas : 0),
      share_delivered_(job_settings.hybrid() ? job_settings.replicas : 0, false),
      broadcast_delivered_(job_settings.hybrid() ? job_settings.replicas : 0, false),
      last_async_step_(job_settings.num_workers, -1) {}

std::string Group::optimizer_name() const {
  absl::MutexLock lock(&mu_);
  return OptimizerName(optimizer_.config());
}

OptimizerConfig Group::optimizer_config() const {
  absl::MutexLock lock(&mu_);
  return optimizer_.config();
}

bool Group::SameSpec(const FlatLayout& layout, const OptimizerConfig& optimizer) const {
  absl::MutexLock lock(&mu_);
  return layout == layout_ && SameOptimizer(optimizer, optimizer_.config());
}

int64_t Group::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

void Group::Close(absl::Status why) {
  absl::MutexLock lock(&mu_);
  if (closed_.ok()) closed_ = std::move(why);  // the waits' conditions see it when the lock is released
}

absl::StatusOr<bool> Group::AwaitVersion(int64_t min_version, absl::Time deadline,
                                         const CallerGone& caller_gone) const {
  FLATSHARD_RETURN_IF_ERROR(CheckOpen());
  const int64_t loads = loads_;
  auto reached_or_loaded = [this, min_version, loads]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return version_ >= min_version || loads_ != loads || !closed_.ok();
  };
  switch (AwaitWhileTheCallerWaits(mu_, absl::Condition(&reached_or_loaded), deadline, caller_gone)) {
    case WaitOutcome::kReady:
      break;
    case WaitOutcome::kTimedOut:
      return absl::DeadlineExceededError(absl::StrCat("group '", name_, "' is at version ", version_,
                                                      "; timed out waiting for version ", min_version));
    case WaitOutcome::kCallerGone:
      return absl::CancelledError(
          absl::StrCat("the caller went away while waiting for version ", min_version, " of group '", name_, "'"));
  }
  FLATSHARD_RETURN_IF_ERROR(CheckOpen());
  return version_ >= min_version;
}

absl::Status Group::AwaitGatherVersion(int64_t min_version, absl::Time deadline, const CallerGone& caller_gone) const {
  FLATSHARD_ASSIGN_OR_RETURN(const bool reached, AwaitVersion(min_version, deadline, caller_gone));
  if (reached) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(
      "group '", name_, "' was loaded from a checkpoint at version ", version_, " while waiting for version ",
      min_version, "; the load dropped the gradients sent for its step in progress: gather version ", version_,
      " and train on from there"));
}

absl::StatusOr<int64_t> Group::WaitVersion(int64_t min_version, absl::Time deadline,
                                           const CallerGone& caller_gone) const {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(AwaitGatherVersion(min_version, deadline, caller_gone));
  return version_;
}

StateStamp Group::state() const {
  absl::MutexLock lock(&mu_);
  return StateStamp{version_, load_epoch_};
}

std::string Group::LoadedState(uint64_t load_id) {
  return load_id == 0 ? std::string("the state from before any checkpoint load")
                      : absl::StrCat("the state of checkpoint load ", absl::Hex(load_id));
}

absl::StatusOr<GatherSnapshot> Group::Gather(int64_t min_version, DType dtype, absl::Time deadline,
                                             const CallerGone& caller_gone) {
  if (!IsFloatingParamDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("gather dtype ", DTypeName(dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(AwaitGatherVersion(min_version, deadline, caller_gone));
  auto& snapshot = snapshots_[DTypeIndex(dtype)];
  if (snapshot == nullptr) {
    const int64_t numel = shard_numel();
    FLATSHARD_ASSIGN_OR_RETURN(
        ShardBuffer bytes,
        snapshot_pool_->Take(numel * DTypeSize(dtype), *compute_,
                             absl::StrCat("group '", name_, "' gather snapshot")));
    FLATSHARD_RETURN_IF_ERROR(compute_->Cast(DType::kFloat32, params_.data(), dtype, bytes.data(), numel));
    FLATSHARD_RETURN_IF_ERROR(compute_->Synchronize());
    snapshot = snapshot_pool_->Wrap(std::move(bytes));
  }
  return GatherSnapshot{{version_, load_epoch_}, snapshot};
}

absl::Status Group::CheckContribution(int64_t step, int worker_rank) const {
  if (job_settings_.async) {
    if (step > version_) {
      return absl::FailedPreconditionError(
          absl::StrCat("future contribution to group '", name_, "' from worker ", worker_rank,
                       ": computed from version ", step, " but the group is at version ", version_));
    }
    if (job_settings_.max_staleness >= 0 && version_ - step > job_settings_.max_staleness) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stale contribution to group '", name_, "' from worker ", worker_rank,
          ": computed from version ", step, ", ", version_ - step,
          " versions old; the bound is ", job_settings_.max_staleness, "; gather version ",
          version_, " and recompute"));
    }
    if (step <= last_async_step_[worker_rank]) {  // applied: a resend finds it there
      return absl::AlreadyExistsError(absl::StrCat(
          "duplicate contribution to group '", name_, "' from worker ", worker_rank,
          ": it already contributed from version ", last_async_step_[worker_rank],
          "; expected a version after it"));
    }
    if (contributions_[worker_rank].state == SlotState::kReceiving) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", worker_rank, "'s contribution to group '", name_, "' is already being received"));
    }
    return absl::OkStatus();
  }
  // After a load, a worker that missed it sends steps of the history the load replaced.
  auto after_load = [&](absl::string_view moved) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return loads_ == 0 ? std::string()
                       : absl::StrCat(" (a checkpoint load sets the group's version: if one moved it ", moved,
                                      ", gather version ", version_, " and train on from there)");
  };
  if (step < version_) {  // applied, with every worker's contribution: this one's too
    return absl::AlreadyExistsError(absl::StrCat("stale contribution to group '", name_, "' from worker ", worker_rank,
                                                 ": step ", step, " was already applied; expected step ", version_,
                                                 after_load("past this step")));
  }
  if (step > version_) {
    return absl::FailedPreconditionError(absl::StrCat("future contribution to group '", name_, "' from worker ",
                                                      worker_rank, ": step ", step, " before step ", version_,
                                                      " is complete; expected step ", version_, after_load("back")));
  }
  switch (contributions_[worker_rank].state) {
    case SlotState::kReady:
      return absl::AlreadyExistsError(
          absl::StrCat("duplicate contribution to group '", name_, "' from worker ", worker_rank,
                       " for step ", step, "; it is waiting for the other workers"));
    case SlotState::kReceiving:
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", worker_rank, "'s contribution to group '", name_,
                       "' for step ", step, " is already being received"));
    case SlotState::kEmpty:
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status Group::CheckDeviceTier(absl::string_view what) const {
  if (compute_->tier() == MemoryTier::kDevice) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, " needs group '", name_, "' in GPU memory; this server runs --memory=",
      MemoryTierName(compute_->tier())));
}

absl::Status Group::CheckShardBytes(DType dtype, uint64_t bytes, absl::string_view plane) const {
  const uint64_t expected = static_cast<uint64_t>(shard_numel()) * DTypeSize(dtype);
  if (bytes == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      plane, " transfer for group '", name_, "' names ", bytes, " bytes; this server's shard is ",
      expected, " (", shard_numel(), " ", DTypeName(dtype), " elements)"));
}

absl::StatusOr<StateStamp> Group::GatherInto(int64_t min_version, DType dtype, void* device_dst, absl::Time deadline,
                                             const CallerGone& caller_gone) {
  FLATSHARD_RETURN_IF_ERROR(CheckDeviceTier("a CUDA IPC gather"));
  if (!IsFloatingParamDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("gather dtype ", DTypeName(dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(AwaitGatherVersion(min_version, deadline, caller_gone));
  FLATSHARD_RETURN_IF_ERROR(compute_->Cast(DType::kFloat32, params_.data(), dtype, device_dst, shard_numel()));
  FLATSHARD_RETURN_IF_ERROR(compute_->Synchronize());
  return StateStamp{version_, load_epoch_};
}

absl::Status Group::FillDeviceSlot(const ReceiveSlot& slot, const void* device_src) {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(compute_->CopyBytes(slot.buffer.data(), device_src, slot.buffer.size()));
  return compute_->Synchronize();
}

absl::StatusOr<std::pair<size_t, size_t>> Group::PartRange(DType dtype, SlotPart part) const {
  const size_t bytes = static_cast<size_t>(shard_numel()) * DTypeSize(dtype);
  if (part.count == 1 && part.index == 0) return std::make_pair(size_t{0}, bytes);
  const std::vector<transport::ByteRange> ranges =
      part.count >= 1 && part.count <= transport::kMaxSplitParts
          ? transport::SplitRanges(bytes, part.count)
          : std::vector<transport::ByteRange>{};
  if (part.index < 0 || part.index >= part.count ||
      static_cast<int>(ranges.size()) != part.count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scatter part ", part.index, " of ", part.count, " to group '", name_, "': a ", bytes,
        "-byte ", DTypeName(dtype), " slice splits into ",
        part.count >= 1 && part.count <= transport::kMaxSplitParts
            ? absl::StrCat(ranges.size(), " parts when asked for ", part.count)
            : absl::StrCat("1 to ", transport::kMaxSplitParts, " parts")));
  }
  return std::make_pair(static_cast<size_t>(ranges[part.index].offset),
                        static_cast<size_t>(ranges[part.index].bytes));
}

absl::StatusOr<ReceiveSlot> Group::BeginScatter(int64_t step, int worker_rank, DType dtype, SlotMemory memory,
                                                SlotPart part, std::optional<uint64_t> from_load) {
  if (worker_rank < 0 || worker_rank >= job_settings_.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("worker rank ", worker_rank, " outside [0, ",
                                                   job_settings_.num_workers, ") of job '",
                                                   job_, "'"));
  }
  if (job_settings_.WorkerReplica(worker_rank) != placement_.replica) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker ", worker_rank, " of job '", job_, "' belongs to replica group ",
        job_settings_.WorkerReplica(worker_rank), "; this server holds shard ", placement_.shard,
        " of replica group ", placement_.replica, " (worker w scatters to replica w % ",
        job_settings_.replicas, ")"));
  }
  if (!IsFloatingParamDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("scatter dtype ", DTypeName(dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(const auto range, PartRange(dtype, part));
  if (part.count > 1 && memory == SlotMemory::kDevice) {
    return absl::InvalidArgumentError("a scatter into device memory comes whole, not in parts");
  }
  if (frozen_) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", name_, "' of job '", job_,
                     "' is frozen (registered without an optimizer): it takes no gradients"));
  }
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(CheckOpen());
  if (from_load.has_value() && *from_load != load_epoch_) {
    return absl::AbortedError(absl::StrCat("worker ", worker_rank, "'s gradient for step ", step, " of group '", name_,
                                           "' was computed from ", LoadedState(*from_load), "; the group now holds ",
                                           LoadedState(load_epoch_), " at version ", version_,
                                           ": gather it and compute the gradient again"));
  }
  Contribution& contribution = contributions_[worker_rank];
  const uint64_t bit = uint64_t{1} << part.index;
  const bool same = contribution.state == SlotState::kReceiving && part.count > 1 &&
                    contribution.step == step && contribution.dtype == dtype &&
                    contribution.parts == part.count;
  if (contribution.state == SlotState::kReceiving && !same && contribution.in_flight == 0) {
    contribution = Contribution{};  // parts of an attempt given up on: start afresh
  }
  const bool joins = same && (contribution.in_flight & bit) == 0;
  if (!joins) {
    FLATSHARD_RETURN_IF_ERROR(CheckContribution(step, worker_rank));
    if (memory == SlotMemory::kDevice) FLATSHARD_RETURN_IF_ERROR(CheckDeviceTier("a CUDA IPC scatter"));
    const size_t bytes = static_cast<size_t>(shard_numel()) * DTypeSize(dtype);
    ShardBuffer& staging =
        memory == SlotMemory::kDevice ? device_staging_[worker_rank] : staging_[worker_rank];
    FLATSHARD_RETURN_IF_ERROR(EnsureStaging(
        staging, bytes, absl::StrCat("worker ", worker_rank, "'s staging slot"), memory));
    contribution = Contribution{.state = SlotState::kReceiving,
                                .dtype = dtype,
                                .data = staging.data(),
                                .step = step,
                                .parts = part.count};
  }
  // A part sent again replaces what it carried before.
  contribution.in_flight |= bit;
  contribution.arrived &= ~bit;
  std::byte* data = static_cast<std::byte*>(contribution.data);
  return ReceiveSlot{step, worker_rank, dtype, absl::MakeSpan(data + range.first, range.second), part};
}

absl::StatusOr<bool> Group::AwaitEarlyStep(int64_t step, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  if (version_ >= step) return true;  // reached between the refusal and this call
  if (job_settings_.async || step != version_ + 1 || ready_count_ < replica_workers_) return false;
  // A load ends the wait too: the step in progress is gone, and what comes of trying
  // again (a refusal of the replaced state, a future step) is the answer.
  const int64_t loads = loads_;
  auto reached = [this, step, loads]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return version_ >= step || loads_ != loads || !closed_.ok();
  };
  if (!AwaitBlocking(mu_, absl::Condition(&reached), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "group '", name_, "' is at version ", version_, ": step ", step,
        " came early and this server's step ", version_, " did not finish in time"));
  }
  FLATSHARD_RETURN_IF_ERROR(CheckOpen());
  return true;
}

absl::Status Group::EnsureStaging(ShardBuffer& buffer, size_t bytes, absl::string_view what,
                                  SlotMemory memory) {
  if (buffer.size() >= bytes) return absl::OkStatus();
  const std::string full_what = absl::StrCat("group '", name_, "' ", what);
  FLATSHARD_ASSIGN_OR_RETURN(buffer, memory == SlotMemory::kDevice
                                         ? compute_->AllocateShard(bytes, full_what)
                                         : compute_->AllocateStaging(bytes, full_what));
  return absl::OkStatus();
}

Group::Contribution* Group::Reserved(const ReceiveSlot& slot) {
  Contribution& contribution = contributions_[slot.worker_rank];
  const bool reserved = contribution.state == SlotState::kReceiving &&
                        contribution.step == slot.step &&
                        (contribution.in_flight & (uint64_t{1} << slot.part.index)) != 0;
  return reserved ? &contribution : nullptr;
}

absl::StatusOr<CommitOutcome> Group::CommitScatter(const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  Contribution* contribution = Reserved(slot);
  if (contribution == nullptr) {
    return absl::AbortedError(absl::StrCat(
        "worker ", slot.worker_rank, "'s contribution to group '", name_, "' for step ", slot.step,
        " was dropped while it arrived (the group was loaded); send it again"));
  }
  const uint64_t bit = uint64_t{1} << slot.part.index;
  contribution->in_flight &= ~bit;
  contribution->arrived |= bit;
  if (!contribution->complete()) return CommitOutcome::kPending;
  if (job_settings_.async) return CommitAsync(slot);
  contribution->state = SlotState::kReady;
  if (++ready_count_ < replica_workers_) return CommitOutcome::kPending;
  const LatencyClock::time_point reduce_start = LatencyClock::now();
  absl::Status reduced = job_settings_.hybrid() ? ReduceOwnPartial() : ReduceContributions();
  if (reduced.ok()) reduce_latency_.RecordSince(reduce_start);
  if (!reduced.ok()) {
    // A kernel failed: nothing was applied and the other contributions stay. This one is
    // dropped, so its worker gets the error and may send again, which retries the step.
    --ready_count_;
    *contribution = Contribution{};
    return reduced;
  }
  if (job_settings_.hybrid()) {
    share_claimed_ = true;
    return CommitOutcome::kShare;
  }
  return FinishReduction();
}

absl::StatusOr<CommitOutcome> Group::FinishReduction() {
  if (job_settings_.needs_norm() && !average_) {
    reduced_ = true;
    return CommitOutcome::kReduced;
  }
  FLATSHARD_RETURN_IF_ERROR(StepOptimizer());
  return CommitOutcome::kApplied;
}

absl::StatusOr<CommitOutcome> Group::CommitAsync(const ReceiveSlot& slot) {
  const LatencyClock::time_point reduce_start = LatencyClock::now();
  const void* data = contributions_[slot.worker_rank].data;
  contributions_[slot.worker_rank] = Contribution{};
  const int64_t numel = shard_numel();
  FLATSHARD_RETURN_IF_ERROR(compute_->Cast(slot.dtype, data, DType::kFloat32, grad_.data(), numel));
  if (job_settings_.reduce_mean && job_settings_.num_workers > 1) {
    FLATSHARD_RETURN_IF_ERROR(compute_->Scale(
        grad_.floats(), numel, 1.0f / static_cast<float>(job_settings_.num_workers)));
  }
  FLATSHARD_RETURN_IF_ERROR(ZeroGradientPadding());
  reduce_latency_.RecordSince(reduce_start);
  last_async_step_[slot.worker_rank] = slot.step;
  FLATSHARD_RETURN_IF_ERROR(StepOptimizer());
  return CommitOutcome::kApplied;
}

bool Group::reduced_at(int64_t step) const {
  absl::MutexLock lock(&mu_);
  return reduced_ && version_ == step;
}

absl::StatusOr<double> Group::NormPartial(double norm_type) const {
  absl::MutexLock lock(&mu_);
  return compute_->NormPartial(grad_.floats(), shard_numel(), norm_type);
}

absl::Status Group::FinishClippedStep(int64_t step, float clip_coef) {
  absl::MutexLock lock(&mu_);
  if (!reduced_ || version_ != step) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' has no reduced gradient for step ",
                                                      step, " (at version ", version_, ")"));
  }
  if (!(clip_coef >= 1.0f)) {
    FLATSHARD_RETURN_IF_ERROR(compute_->Scale(grad_.floats(), shard_numel(), clip_coef));
  }
  reduced_ = false;
  return StepOptimizer();
}

absl::Status Group::SkipStep(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (!reduced_ || version_ != step) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' has no reduced gradient for step ",
                                                      step, " (at version ", version_, ")"));
  }
  AwaitStepAllowed();  // a save or export is reading this version, or about to
  reduced_ = false;
  AdvanceVersion();
  return absl::OkStatus();
}

void Group::AbortScatter(const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  Contribution* contribution = Reserved(slot);
  if (contribution == nullptr) return;  // dropped already
  // The parts that arrived stay for a part sent again to complete (BeginScatter).
  contribution->in_flight &= ~(uint64_t{1} << slot.part.index);
  if (contribution->in_flight == 0 && contribution->arrived == 0) *contribution = Contribution{};
}

absl::Status Group::ReduceContributions() {
  // A job of one worker whose gradient came as float32 is its own reduction (a mean over
  // one divides by 1). On the CPU tiers staging slots and shards are the same kind of
  // memory, so the slot and the gradient buffer trade places instead of being copied.
  if (job_settings_.num_workers == 1 && contributions_[0].dtype == DType::kFloat32 &&
      compute_->tier() != MemoryTier::kDevice && contributions_[0].data == staging_[0].data() &&
      staging_[0].size() == grad_.size()) {
    std::swap(staging_[0], grad_);
    return ZeroGradientPadding();
  }
  // Worker-rank order makes the fp32 sum bitwise reproducible.
  std::vector<kernels::Contribution> contributions;
  for (int worker = 0; worker < job_settings_.num_workers; ++worker) {
    contributions.push_back({contributions_[worker].dtype, contributions_[worker].data});
  }
  FLATSHARD_RETURN_IF_ERROR(compute_->Reduce(contributions, grad_.floats(), shard_numel(), ReduceAlpha()));
  FLATSHARD_RETURN_IF_ERROR(ZeroGradientPadding());
  // The staging slots are free for the next step only once the kernels have read them.
  return compute_->Synchronize();
}

float Group::ReduceAlpha() const {
  const bool mean = job_settings_.reduce_mean || average_;
  return mean ? 1.0f / static_cast<float>(job_settings_.num_workers) : 1.0f;
}

absl::Status Group::ZeroGradientPadding() {
  for (const auto& [offset, count] : padding_runs_) {
    FLATSHARD_RETURN_IF_ERROR(compute_->Zero(grad_.floats() + offset, count));
  }
  return absl::OkStatus();
}

void Group::AwaitUnpinned() const {
  auto unpinned = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pins_ == 0; };
  AwaitBlocking(mu_, absl::Condition(&unpinned));
}

void Group::AwaitStepAllowed() const {
  auto allowed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pins_ == 0 && !holds_.contains(version_); };
  AwaitBlocking(mu_, absl::Condition(&allowed));
}

absl::Status Group::AwaitCut(int64_t version, absl::Time deadline) const {
  FLATSHARD_ASSIGN_OR_RETURN(const bool reached, AwaitVersion(version, deadline));
  if (reached) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' was loaded from a checkpoint at version ",
                                                    version_, " while waiting for the cut's version ", version,
                                                    ", which was cut from the state the load replaced"));
}

void Group::HoldAt(int64_t version) {
  absl::MutexLock lock(&mu_);
  holds_.insert(version);
}

void Group::ReleaseHold(int64_t version) {
  absl::MutexLock lock(&mu_);
  if (auto it = holds_.find(version); it != holds_.end()) holds_.erase(it);
}

absl::StatusOr<ShardSnapshot> Group::Pin(int64_t version, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(AwaitCut(version, deadline));
  if (version_ != version) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' is at version ", version_,
                                                      ", past the requested version ", version));
  }
  ++pins_;
  ShardSnapshot metadata{version_, {}, optimizer_.steps(), optimizer_.momentum_initialized(), {}};
  for (const std::string& name : optimizer_.state_names()) metadata.state.emplace_back(name, HostFloats());
  return metadata;
}

void Group::Unpin() {
  absl::MutexLock lock(&mu_);
  --pins_;
}

absl::Status Group::ReadPinned(absl::string_view state, int64_t offset, int64_t count, float* out) const {
  absl::MutexLock lock(&mu_);
  if (!state.empty()) return optimizer_.ReadStateSlice(state, offset, count, out);
  if (offset < 0 || count < 0 || offset + count > shard_numel()) {
    return absl::OutOfRangeError(absl::StrCat("elements [", offset, ", ", offset + count, ") of group '",
                                              name_, "' shard of ", shard_numel()));
  }
  return compute_->CopyToHost(params_.floats() + offset, out, count);
}

absl::Status Group::StepOptimizer() {
  const int64_t generation = generation_;
  AwaitStepAllowed();  // a save or export is reading this version, or about to
  if (generation_ != generation) {
    return absl::AbortedError(absl::StrCat("group '", name_, "' was loaded or re-initialized during the step"));
  }
  const LatencyClock::time_point start = LatencyClock::now();
  FLATSHARD_RETURN_IF_ERROR(optimizer_.Step(params_.floats(), grad_.floats()));
  FLATSHARD_RETURN_IF_ERROR(compute_->Synchronize());
  optimizer_latency_.RecordSince(start);
  AdvanceVersion();
  return absl::OkStatus();
}

void Group::AdvanceVersion() {
  ++version_;
  ready_count_ = 0;
  if (!job_settings_.async) std::fill(contributions_.begin(), contributions_.end(), Contribution{});
  ResetExchange();
  PublishNewValues();
}

void Group::PublishNewValues() {
  for (auto& snapshot : snapshots_) snapshot.reset();
}

absl::StatusOr<ReceiveSlot> Group::BeginPushInit(DType dtype) {
  if (!IsFloatingParamDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("init dtype ", DTypeName(dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  absl::MutexLock lock(&mu_);
  if (version_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group '", name_, "' is at version ", version_,
        "; initial values can only be pushed before the first step (load a checkpoint instead)"));
  }
  if (init_receiving_) {
    return absl::FailedPreconditionError(
        absl::StrCat("initial values for group '", name_, "' are already being received"));
  }
  const size_t bytes = static_cast<size_t>(shard_numel()) * DTypeSize(dtype);
  FLATSHARD_RETURN_IF_ERROR(EnsureStaging(init_staging_, bytes, "initial values"));
  init_receiving_ = true;
  return ReceiveSlot{0, 0, dtype, init_staging_.bytes().subspan(0, bytes), {}};
}

absl::Status Group::CommitPushInit(const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  init_receiving_ = false;
  absl::Cleanup free_staging = [this] { init_staging_ = ShardBuffer(); };
  if (version_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", name_, "' stepped while initial values were received"));
  }
  // WriteTensorElements zeroes the padding, whatever the sender put there: float32 values
  // go from the staging buffer itself, the others widened on the host first.
  if (slot.dtype == DType::kFloat32) return WriteTensorElements(absl::MakeSpan(init_staging_.floats(), shard_numel()));
  std::vector<float> values(shard_numel());
  FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Cast(slot.dtype, init_staging_.data(), DType::kFloat32,
                                               values.data(), shard_numel()));
  return WriteTensorElements(absl::MakeSpan(values));
}

absl::Status Group::WriteTensorElements(absl::Span<float> host_shard) {
  AwaitUnpinned();
  ++generation_;
  for (const auto& [offset, count] : padding_runs_) {
    std::fill_n(host_shard.begin() + offset, count, 0.0f);
  }
  FLATSHARD_RETURN_IF_ERROR(compute_->CopyFromHost(host_shard.data(), params_.floats(), shard_numel()));
  FLATSHARD_RETURN_IF_ERROR(optimizer_.Reset());
  FLATSHARD_RETURN_IF_ERROR(compute_->Synchronize());
  PublishNewValues();
  return absl::OkStatus();
}

void Group::AbortPushInit(const ReceiveSlot&) {
  absl::MutexLock lock(&mu_);
  init_receiving_ = false;
  init_staging_ = ShardBuffer();
}

absl::Status Group::InitFromSeed(uint64_t seed) {
  absl::MutexLock lock(&mu_);
  if (version_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group '", name_, "' is at version ", version_, "; it can only be initialized before the first step"));
  }
  std::vector<float> values(shard_numel(), 0.0f);
  const int64_t start = layout_.shard_start(placement_.shard);
  for (const TensorPiece& piece : layout_.MapRange(start, layout_.shard_end(placement_.shard))) {
    const TensorSpec& spec = layout_.tensor(piece.tensor_index);
    const float bound = InitBound(spec, layout_.tensor_numel(piece.tensor_index));
    const uint64_t stream = SplitMix64(seed ^ Fnv1a(spec.fqn));
    for (int64_t k = 0; k < piece.numel; ++k) {
      const uint64_t bits = SplitMix64(stream + static_cast<uint64_t>(piece.intra_start + k));
      const float unit = static_cast<float>(bits >> 40) * 0x1.0p-24f;  // [0, 1)
      values[piece.flat_offset - start + k] = (2.0f * unit - 1.0f) * bound;
    }
  }
  return WriteTensorElements(absl::MakeSpan(values));
}

absl::Status Group::SetOptimizer(const OptimizerConfig& optimizer) {
  FLATSHARD_RETURN_IF_ERROR(ValidateOptimizer(optimizer));
  absl::MutexLock lock(&mu_);
  return optimizer_.SetConfig(optimizer);
}

absl::Status Group::CheckOptimizer(const OptimizerConfig& optimizer) const {
  FLATSHARD_RETURN_IF_ERROR(ValidateOptimizer(optimizer));
  absl::MutexLock lock(&mu_);
  return optimizer_.CheckConfig(optimizer);
}

absl::StatusOr<ShardSnapshot> Group::Snapshot(int64_t version, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(AwaitCut(version, deadline));
  // A clipped step that is reduced but waits for the global norm has not touched the
  // parameters or the optimizer state yet: they are still exactly `version`.
  if (version_ != version) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' is at version ", version_,
                                                      ", past the requested version ", version));
  }
  ShardSnapshot snapshot{version_, {}, optimizer_.steps(), optimizer_.momentum_initialized(), {}};
  ResizeWithHugePages(snapshot.params, shard_numel());
  FLATSHARD_RETURN_IF_ERROR(compute_->CopyToHost(params_.floats(), snapshot.params.data(), shard_numel()));
  for (const std::string& name : optimizer_.state_names()) {
    FLATSHARD_ASSIGN_OR_RETURN(HostFloats values, optimizer_.ReadState(name));
    snapshot.state.emplace_back(name, std::move(values));
  }
  return snapshot;
}

absl::Status Group::Restore(LoadedShard loaded, uint64_t load_id, const KeptState& kept) {
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(CheckOpen());
  if (loaded.params.numel() != shard_numel()) {
    return absl::InvalidArgumentError(absl::StrCat("group '", name_, "': loaded shard of ", loaded.params.numel(),
                                                   " elements for a shard of ", shard_numel()));
  }
  for (const ShardRange& range : kept.ranges) {
    if (range.begin < 0 || range.begin > range.end || range.end > shard_numel()) {
      return absl::InvalidArgumentError(absl::StrCat("group '", name_, "': kept elements [", range.begin, ", ",
                                                     range.end, ") of a shard of ", shard_numel()));
    }
  }
  AwaitUnpinned();
  // What the load keeps, from the state it replaces (the step that AwaitUnpinned may have
  // let finish included).
  if (kept.optimizer_counters) {
    loaded.optimizer_steps = optimizer_.steps();
    loaded.momentum_initialized = optimizer_.momentum_initialized();
  }
  if (kept.version) loaded.version = version_;
  for (const ShardRange& range : kept.ranges) {
    const int64_t count = range.end - range.begin;
    FLATSHARD_RETURN_IF_ERROR(
        compute_->CopyToHost(params_.floats() + range.begin, loaded.params.floats() + range.begin, count));
    for (auto& [state, values] : loaded.state) {
      FLATSHARD_RETURN_IF_ERROR(
          optimizer_.ReadStateSlice(state, range.begin, count, values.floats() + range.begin));
    }
  }
  ++generation_;
  FLATSHARD_RETURN_IF_ERROR(
      optimizer_.Restore(loaded.optimizer_steps, loaded.momentum_initialized, std::move(loaded.state)));
  if (compute_->tier() == MemoryTier::kHost) {
    params_ = std::move(loaded.params);
  } else {
    FLATSHARD_RETURN_IF_ERROR(compute_->CopyFromHost(loaded.params.floats(), params_.floats(), shard_numel()));
  }
  version_ = loaded.version;
  ++loads_;
  if (load_id != load_epoch_) {
    left_load_epochs_.insert(load_epoch_);
    load_epoch_ = load_id;
  }
  ready_count_ = 0;
  reduced_ = false;
  std::fill(contributions_.begin(), contributions_.end(), Contribution{});
  ResetExchange();
  std::fill(last_async_step_.begin(), last_async_step_.end(), loaded.version - 1);
  PublishNewValues();
  return absl::OkStatus();
}

std::vector<std::string> Group::optimizer_state_names() const {
  absl::MutexLock lock(&mu_);
  return optimizer_.state_names();
}

GroupStats Group::stats() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = static_cast<int64_t>(params_.size() + grad_.size()) + optimizer_.state_bytes();
  for (const auto& staging : staging_) bytes += static_cast<int64_t>(staging.size());
  for (const auto& staging : device_staging_) bytes += static_cast<int64_t>(staging.size());
  for (const auto& chunk : partial_chunks_) bytes += static_cast<int64_t>(chunk.size());
  bytes += static_cast<int64_t>(own_partial_.size() + reduced_staging_.size() + init_staging_.size());
  // Gather snapshots: the current version's (one per dtype gathered) and the idle ones the
  // next version's reuse; not those older versions' readers still hold.
  for (const auto& snapshot : snapshots_) bytes += snapshot == nullptr ? 0 : static_cast<int64_t>(snapshot->size());
  bytes += snapshot_pool_->free_bytes();
  std::vector<int32_t> contributors;
  if (!job_settings_.async) {
    for (size_t worker = 0; worker < contributions_.size(); ++worker) {
      if (contributions_[worker].state != SlotState::kEmpty) contributors.push_back(static_cast<int32_t>(worker));
    }
  }
  return GroupStats{version_, bytes, ready_count_, std::move(contributors), load_epoch_};
}

}  // namespace flatshard::server
