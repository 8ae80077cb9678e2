#include "server/group.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"

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

}  // namespace

Group::Group(std::string job, std::string name, FlatLayout layout, int rank,
             JobSettings job_settings, OptimizerConfig optimizer)
    : job_(std::move(job)),
      name_(std::move(name)),
      layout_(std::move(layout)),
      rank_(rank),
      job_settings_(job_settings),
      params_(layout_.shard_numel(), 0.0f),
      grad_(layout_.shard_numel(), 0.0f),
      optimizer_(std::move(optimizer), layout_.shard_numel()),
      slot_states_(job_settings.num_workers, SlotState::kEmpty),
      slot_dtypes_(job_settings.num_workers, DType::kFloat32),
      staging_(job_settings.num_workers),
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

absl::StatusOr<int64_t> Group::WaitVersion(int64_t min_version, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto reached = [this, min_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return version_ >= min_version;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&reached), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("group '", name_, "' is at version ", version_,
                                                    "; timed out waiting for version ",
                                                    min_version));
  }
  return version_;
}

absl::StatusOr<GatherSnapshot> Group::Gather(int64_t min_version, DType dtype,
                                             absl::Time deadline) {
  if (!IsFloatingParamDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("gather dtype ", DTypeName(dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  FLATSHARD_RETURN_IF_ERROR(WaitVersion(min_version, deadline).status());
  absl::MutexLock lock(&mu_);
  auto& snapshot = snapshots_[DTypeIndex(dtype)];
  if (snapshot == nullptr) {
    auto bytes = std::make_shared<std::vector<std::byte>>(params_.size() * DTypeSize(dtype));
    FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Cast(DType::kFloat32, params_.data(), dtype,
                                                 bytes->data(), static_cast<int64_t>(params_.size())));
    snapshot = std::move(bytes);
  }
  return GatherSnapshot{version_, snapshot};
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
    if (step <= last_async_step_[worker_rank]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "duplicate contribution to group '", name_, "' from worker ", worker_rank,
          ": it already contributed from version ", last_async_step_[worker_rank],
          "; expected a version after it"));
    }
    if (slot_states_[worker_rank] == SlotState::kReceiving) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", worker_rank, "'s contribution to group '", name_, "' is already being received"));
    }
    return absl::OkStatus();
  }
  if (step < version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("stale contribution to group '", name_, "' from worker ", worker_rank,
                     ": step ", step, " was already applied; expected step ", version_));
  }
  if (step > version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("future contribution to group '", name_, "' from worker ", worker_rank,
                     ": step ", step, " before step ", version_, " is complete; expected step ",
                     version_));
  }
  switch (slot_states_[worker_rank]) {
    case SlotState::kReady:
      return absl::FailedPreconditionError(
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

absl::StatusOr<ReceiveSlot> Group::BeginScatter(int64_t step, int worker_rank, DType dtype) {
  if (worker_rank < 0 || worker_rank >= job_settings_.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("worker rank ", worker_rank, " outside [0, ",
                                                   job_settings_.num_workers, ") of job '",
                                                   job_, "'"));
  }
  if (!IsFloatingParamDType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("scatter dtype ", DTypeName(dtype),
                                                   " is not float32, bfloat16 or float16"));
  }
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(CheckContribution(step, worker_rank));
  slot_states_[worker_rank] = SlotState::kReceiving;
  slot_dtypes_[worker_rank] = dtype;
  std::vector<std::byte>& staging = staging_[worker_rank];
  staging.resize(params_.size() * DTypeSize(dtype));
  return ReceiveSlot{step, worker_rank, dtype, absl::MakeSpan(staging)};
}

absl::StatusOr<CommitOutcome> Group::CommitScatter(const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  if (job_settings_.async) return CommitAsync(slot);
  slot_states_[slot.worker_rank] = SlotState::kReady;
  if (++ready_count_ < job_settings_.num_workers) return CommitOutcome::kPending;
  ReduceContributions();
  if (job_settings_.clipping()) {
    reduced_ = true;
    return CommitOutcome::kReduced;
  }
  StepOptimizer();
  return CommitOutcome::kApplied;
}

CommitOutcome Group::CommitAsync(const ReceiveSlot& slot) {
  // Cannot fail: the dtype was checked in BeginScatter.
  (void)kernels::cpu::Cast(slot.dtype, staging_[slot.worker_rank].data(), DType::kFloat32,
                           grad_.data(), static_cast<int64_t>(grad_.size()));
  if (job_settings_.reduce_mean && job_settings_.num_workers > 1) {
    kernels::cpu::Scale(absl::MakeSpan(grad_), 1.0f / static_cast<float>(job_settings_.num_workers));
  }
  last_async_step_[slot.worker_rank] = slot.step;
  slot_states_[slot.worker_rank] = SlotState::kEmpty;
  StepOptimizer();
  return CommitOutcome::kApplied;
}

bool Group::reduced_at(int64_t step) const {
  absl::MutexLock lock(&mu_);
  return reduced_ && version_ == step;
}

double Group::NormPartial(double norm_type) const {
  absl::MutexLock lock(&mu_);
  if (std::isinf(norm_type)) return kernels::cpu::MaxAbs(grad_);
  return kernels::cpu::SquaredNorm(grad_);
}

absl::Status Group::FinishClippedStep(int64_t step, float clip_coef) {
  absl::MutexLock lock(&mu_);
  if (!reduced_ || version_ != step) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' has no reduced gradient for step ",
                                                      step, " (at version ", version_, ")"));
  }
  if (!(clip_coef >= 1.0f)) kernels::cpu::Scale(absl::MakeSpan(grad_), clip_coef);
  reduced_ = false;
  StepOptimizer();
  return absl::OkStatus();
}

void Group::AbortScatter(const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  slot_states_[slot.worker_rank] = SlotState::kEmpty;
}

void Group::ReduceContributions() {
  const absl::Span<float> grad = absl::MakeSpan(grad_);
  // Worker-rank order makes the fp32 sum bitwise reproducible.
  for (int worker = 0; worker < job_settings_.num_workers; ++worker) {
    const void* contribution = staging_[worker].data();
    if (worker == 0) {
      // Cast cannot fail: the dtype was checked in BeginScatter.
      (void)kernels::cpu::Cast(slot_dtypes_[0], contribution, DType::kFloat32, grad.data(),
                               static_cast<int64_t>(grad.size()));
    } else {
      (void)kernels::cpu::Accumulate(slot_dtypes_[worker], contribution, grad);
    }
  }
  if (job_settings_.reduce_mean && job_settings_.num_workers > 1) {
    kernels::cpu::Scale(grad, 1.0f / static_cast<float>(job_settings_.num_workers));
  }
}

void Group::StepOptimizer() {
  optimizer_.Step(absl::MakeSpan(params_), grad_);
  ++version_;
  ready_count_ = 0;
  if (!job_settings_.async) std::fill(slot_states_.begin(), slot_states_.end(), SlotState::kEmpty);
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
  init_receiving_ = true;
  init_staging_.resize(params_.size() * DTypeSize(dtype));
  return ReceiveSlot{0, 0, dtype, absl::MakeSpan(init_staging_)};
}

absl::Status Group::CommitPushInit(const ReceiveSlot& slot) {
  absl::MutexLock lock(&mu_);
  init_receiving_ = false;
  if (version_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", name_, "' stepped while initial values were received"));
  }
  // Widen into the scratch gradient buffer, then copy only tensor elements: padding
  // stays zero whatever the sender put there.
  FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Cast(slot.dtype, init_staging_.data(), DType::kFloat32,
                                               grad_.data(), static_cast<int64_t>(grad_.size())));
  std::fill(params_.begin(), params_.end(), 0.0f);
  const int64_t start = layout_.shard_start(rank_);
  for (const TensorPiece& piece : layout_.MapRange(start, layout_.shard_end(rank_))) {
    std::copy_n(grad_.begin() + (piece.flat_offset - start), piece.numel,
                params_.begin() + (piece.flat_offset - start));
  }
  optimizer_.Reset();
  PublishNewValues();
  return absl::OkStatus();
}

void Group::AbortPushInit(const ReceiveSlot&) {
  absl::MutexLock lock(&mu_);
  init_receiving_ = false;
}

absl::Status Group::InitFromSeed(uint64_t seed) {
  absl::MutexLock lock(&mu_);
  if (version_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group '", name_, "' is at version ", version_, "; it can only be initialized before the first step"));
  }
  std::fill(params_.begin(), params_.end(), 0.0f);
  const int64_t start = layout_.shard_start(rank_);
  for (const TensorPiece& piece : layout_.MapRange(start, layout_.shard_end(rank_))) {
    const TensorSpec& spec = layout_.tensor(piece.tensor_index);
    const float bound = InitBound(spec, layout_.tensor_numel(piece.tensor_index));
    const uint64_t stream = SplitMix64(seed ^ Fnv1a(spec.fqn));
    for (int64_t k = 0; k < piece.numel; ++k) {
      const uint64_t bits = SplitMix64(stream + static_cast<uint64_t>(piece.intra_start + k));
      const float unit = static_cast<float>(bits >> 40) * 0x1.0p-24f;  // [0, 1)
      params_[piece.flat_offset - start + k] = (2.0f * unit - 1.0f) * bound;
    }
  }
  optimizer_.Reset();
  PublishNewValues();
  return absl::OkStatus();
}

absl::Status Group::SetOptimizer(const OptimizerConfig& optimizer) {
  FLATSHARD_RETURN_IF_ERROR(ValidateOptimizer(optimizer));
  absl::MutexLock lock(&mu_);
  return optimizer_.SetConfig(optimizer);
}

absl::StatusOr<ShardSnapshot> Group::Snapshot(int64_t version, absl::Time deadline) const {
  FLATSHARD_RETURN_IF_ERROR(WaitVersion(version, deadline).status());
  absl::MutexLock lock(&mu_);
  // A clipped step that is reduced but waits for the global norm has not touched the
  // parameters or the optimizer state yet: they are still exactly `version`.
  if (version_ != version) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' is at version ", version_,
                                                      ", past the requested version ", version));
  }
  ShardSnapshot snapshot{version_, params_, optimizer_.steps(), optimizer_.momentum_initialized(), {}};
  for (const std::string& name : optimizer_.state_names()) {
    const absl::Span<const float> values = optimizer_.state(name);
    snapshot.state.emplace_back(name, std::vector<float>(values.begin(), values.end()));
  }
  return snapshot;
}

absl::Status Group::Restore(ShardSnapshot snapshot) {
  absl::MutexLock lock(&mu_);
  if (snapshot.params.size() != params_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("group '", name_, "': snapshot of ", snapshot.params.size(),
                                                   " elements for a shard of ", params_.size()));
  }
  FLATSHARD_RETURN_IF_ERROR(
      optimizer_.Restore(snapshot.optimizer_steps, snapshot.momentum_initialized, std::move(snapshot.state)));
  params_ = std::move(snapshot.params);
  version_ = snapshot.version;
  ready_count_ = 0;
  reduced_ = false;
  std::fill(slot_states_.begin(), slot_states_.end(), SlotState::kEmpty);
  std::fill(last_async_step_.begin(), last_async_step_.end(), snapshot.version - 1);
  PublishNewValues();
  return absl::OkStatus();
}

std::vector<std::string> Group::optimizer_state_names() const {
  absl::MutexLock lock(&mu_);
  return optimizer_.state_names();
}

GroupStats Group::stats() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = static_cast<int64_t>((params_.size() + grad_.size()) * sizeof(float)) +
                  optimizer_.state_bytes();
  for (const auto& staging : staging_) bytes += static_cast<int64_t>(staging.capacity());
  return GroupStats{version_, bytes, ready_count_};
}

}  // namespace flatshard::server
