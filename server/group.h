// Group: one flat parameter's shard on this server and the step engine around it
// (DESIGN.md, "The training step", synchronous mode).
//
//  - version() = steps completed: optimizer steps applied, plus steps skipped as
//    non-finite (skip_nonfinite). Gathers wait (with a deadline) for a version.
//  - Each of the job's W workers contributes its gradient slice for step == version()
//    exactly once. A contribution the group already holds or applied (a duplicate, or a
//    stale step, which in sync mode was applied with every worker's) is AlreadyExists, so
//    a worker that lost an answer may send again and learn its gradient arrived; future
//    steps are FailedPrecondition. Both name the expected step.
//  - When all W are in, the server reduces them in fp32 in worker-rank order (bitwise
//    reproducible), divides by W for a mean, runs the optimizer and publishes v + 1.
//  - Hybrid sharding (server/job.h): only the workers of this server's replica group
//    contribute here. Their fp32 sum, in worker-rank order, is this replica's partial.
//    The servers holding this shard in the R replica groups then all-reduce their
//    partials as a reduce-scatter followed by an all-gather: the shard is cut into R
//    chunks (ReplicaChunk), and replica group q's server reduces chunk q.
//     1. kShare: the caller sends chunk q of the partial (SharedPartial) to replica group
//        q's server, for every q but this one, then calls CommitOwnPartial.
//     2. The others' partials of this server's chunk arrive (Exchange::kPartial). Once
//        all R are in, they are added in replica order and divided by W for a mean
//        (kBroadcast): the caller sends the chunk (BroadcastChunk) to every other replica
//        group, then calls CommitBroadcast.
//     3. The other chunks arrive reduced from their owners (Exchange::kReduced). With all
//        R chunks in, the step goes on as after the last contribution.
//    Every replica group ends with the same bits; each server sends 2(R-1)/R of a shard.
//    A message and the sender's records of it belong to one round (ExchangeRound): the
//    step and the load the group's state comes from. A load's Restore starts a new
//    round even at the same version, so a chunk of the replaced state that is still in
//    flight is refused (Aborted) rather than taken for the step taken again.
//  - With gradient clipping (or skip_nonfinite), the reduced gradient waits (kReduced)
//    until the job's global norm is known (server/clip_coordinator.h), which then calls
//    FinishClippedStep with the clip coefficient (or SkipStep for a non-finite norm).
//  - Async mode: each contribution (step = the version it was computed from) is applied
//    on arrival as one optimizer step, scaled by 1/W for a mean; contributions older
//    than max_staleness versions, or not newer than the worker's last one, are refused.
//  - A frozen group (optimizer Frozen) holds parameters only: no gradient buffer, no
//    optimizer state, every scatter refused, and its version stays where it is.
//  - An average group (optimizer Average: module buffers) takes the mean of the workers'
//    contributions as its new values at each step, whatever the job's reduce; it steps
//    as soon as it is reduced, outside the job's gradient norm (a clipped or skipped step
//    still updates it, as a forward updates torch's buffers). SYNC jobs only.
//  - A contribution is received in two phases so the bytes land straight in its staging
//    slot without holding the lock: BeginScatter reserves the slot, the caller fills
//    it, then CommitScatter (or AbortScatter if the transfer failed: the worker may
//    send again, nothing partial is ever applied).
//  - A contribution may come in parts (SlotPart), each reserved, filled and committed
//    like a whole one and possibly at once on several connections; it counts when its
//    last part is committed. A part that is sent again replaces what it carried; the
//    parts that arrived stay until the contribution is complete, or until, with none in
//    flight, a BeginScatter for another step, dtype or split starts it afresh.
//  - A load (Restore) drops the contributions being received: their commits are refused
//    with Aborted. A contribution that names the load its parameters were gathered from
//    (every worker's, once it has gathered) is refused with Aborted when the group holds
//    another load's state: a gradient of the replaced state never counts for the loaded
//    one, even at the same version. Gathers name the load their bytes come from. Waits
//    for a version it moved the group below end at once (Aborted for gathers,
//    FailedPrecondition for the pins of saves and exports), and so do waits for an early
//    step (AwaitEarlyStep). The exchange starts a new round (ExchangeRound).
//  - Deleting its job (Registry::DeleteJob) closes the group (Close): every wait ends
//    with NotFound, and gathers, scatters, exchanges and loads that found it before are
//    refused the same way; its memory goes when the last request holding it lets go.
//
// Memory: parameters, the reduced gradient and optimizer state live in the group's
// memory tier (server/shard_compute.h: host, pinned or device); staging slots, replica
// partials and gather snapshots are host-addressable memory the tier's kernels reach
// directly.
//
// Thread-safe: every public method may be called from any thread. The exchange's methods
// are defined in group_exchange.cc, the rest in group.cc.
//
//   auto slot = group.BeginScatter(step, worker, DType::kBFloat16);
//   conn.Recv(slot->buffer);  group.CommitScatter(*slot);
#ifndef FLATSHARD_SERVER_GROUP_H_
#define FLATSHARD_SERVER_GROUP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/huge_pages.h"
#include "core/layout.h"
#include "server/caller_wait.h"
#include "server/host_slab.h"
#include "server/job.h"
#include "server/latency_histogram.h"
#include "server/optimizer.h"
#include "server/shard_buffer.h"
#include "server/shard_compute.h"
#include "server/snapshot_pool.h"

namespace flatshard::server {

// Which state a group held: its version, and the checkpoint load that state comes from
// (Restore's load id; 0: none).
struct StateStamp {
  int64_t version = 0;
  uint64_t load_id = 0;
};

// Immutable bytes of the shard in one state, in one dtype; shared by all gathers of that
// state.
struct GatherSnapshot {
  StateStamp state;
  std::shared_ptr<const ShardBuffer> bytes;  // host-addressable
};

// Which part of a contribution one receive carries: range `index` of
// transport::SplitRanges(the contribution's bytes, `count`). {0, 1}: all of it.
struct SlotPart {
  int index = 0;
  int count = 1;
};

// A reserved staging slot for one worker's contribution (scatter), or a part of it, or
// for pushed initial values. `buffer` is owned by the Group and valid until
// Commit/Abort.
struct ReceiveSlot {
  int64_t step = 0;
  int worker_rank = 0;
  DType dtype = DType::kFloat32;
  absl::Span<std::byte> buffer;  // host memory, or device memory for SlotMemory::kDevice
  SlotPart part;                 // scatters: the part `buffer` holds
  uint64_t load_epoch = 0;       // exchanges: the round's load (ExchangeRound)
};

// Where a scatter's staging slot lives: host-addressable (the TCP data plane writes it)
// or device memory of a --memory=device group (the CUDA IPC plane copies into it).
enum class SlotMemory { kHost, kDevice };

enum class CommitOutcome {
  kPending,  // waiting for other workers' contributions (or other replicas' partials)
  kApplied,  // the optimizer step ran; the version advanced
  kReduced,  // clipped job: reduced, waiting for the job's gradient norm
  kShare,      // hybrid job: this replica's partial is summed; share it (SharedPartial)
  kBroadcast,  // hybrid job: this server's chunk is reduced; broadcast it (BroadcastChunk)
};

// What one replica group's server sends another in a hybrid job's exchange (Group).
enum class Exchange {
  kPartial,  // its partial of the receiver's chunk
  kReduced,  // its own chunk, reduced
};

// One round of a hybrid job's exchange: `step` of the group state that checkpoint load
// `load_epoch` installed (the load's id, the same on every server; 0 before any load).
struct ExchangeRound {
  int64_t step = 0;
  uint64_t load_epoch = 0;
  bool operator==(const ExchangeRound&) const = default;
};

// What kShare or kBroadcast hands over to be sent: fp32 bytes in host memory, valid
// while the group is in `round`, and the round they belong to.
struct OutgoingChunk {
  ExchangeRound round;
  absl::Span<const std::byte> bytes;
};

// This server's shard of a group at one version: parameters (fp32 master, shard_numel
// elements, padding included) and optimizer state, in `Buffer`s of host memory.
template <typename Buffer>
struct ShardState {
  int64_t version = 0;
  Buffer params;
  int64_t optimizer_steps = 0;
  bool momentum_initialized = false;
  std::vector<std::pair<std::string, Buffer>> state;  // by torch's names
};

// A consistent copy (Snapshot), or the metadata of a pinned shard (Pin).
using ShardSnapshot = ShardState<HostFloats>;
// A shard read from a checkpoint, in buffers from AllocateHostUnwritten, for
// Group::Restore: a group on the host tier adopts them as they are, others copy them
// into their tier.
using LoadedShard = ShardState<ShardBuffer>;

// Elements [begin, end) of a group's shard on this server.
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// What a load keeps of a group's current state (a non-strict load's tensors that the
// checkpoint lacks): the parameters and optimizer state of `ranges`; for a group the
// checkpoint holds nothing of, also the optimizer's step count and momentum flag
// (`optimizer_counters`), and its version unless the load gives it one (`version`).
struct KeptState {
  std::vector<ShardRange> ranges;
  bool optimizer_counters = false;
  bool version = false;
};

struct GroupStats {
  int64_t version = 0;
  // The group's memory on this server: parameters, gradient, optimizer state, staging
  // slots, exchange buffers, a push's staging while it lasts, and gather snapshots (the
  // current version's and the idle ones kept for the next).
  int64_t bytes = 0;
  int pending_contributions = 0;
  // Sync jobs: the workers whose gradient for step `version` this server holds or is
  // receiving, in rank order.
  std::vector<int32_t> step_contributors;
  uint64_t load_id = 0;  // the load its state comes from (Restore; 0: none)
};

class Group {
 public:
  // `layout` is the group's layout over `placement.shards` servers; this server holds
  // shard `placement.shard` (of replica group `placement.replica`) in `tier`, whose CPU
  // kernels run on `pool` (null: on the calling thread).
  // On the host tier, its small buffers (parameters, gradient, optimizer state: each
  // under HostSlab::kMaxPieceBytes) are pieces of `small_buffers` when given, so that a
  // call making many small groups maps a few blocks instead of growing the heap for
  // each buffer; other tiers ignore it.
  // ResourceExhausted naming the group and the bytes when the tier cannot hold it;
  // FailedPrecondition for a tier this build or machine lacks.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<Group>> Create(
      std::string job, std::string name, FlatLayout layout, Placement placement, JobSettings job_settings,
      OptimizerConfig optimizer, MemoryTier tier = MemoryTier::kHost,
      std::shared_ptr<const ComputePool> pool = nullptr, HostSlab* small_buffers = nullptr);

  MemoryTier memory_tier() const { return compute_->tier(); }

  const std::string& job() const { return job_; }
  const std::string& name() const { return name_; }
  const FlatLayout& layout() const { return layout_; }
  const Placement& placement() const { return placement_; }
  int64_t shard_numel() const { return layout_.shard_numel(); }
  std::string optimizer_name() const;
  OptimizerConfig optimizer_config() const;
  // Registered with optimizer Frozen (fixed for the group's life).
  bool frozen() const { return frozen_; }
  // Its reduced gradient counts for the job's norm (clipping, skip_nonfinite): neither
  // frozen nor an average group (fixed for the group's life).
  bool in_norm() const { return !frozen_ && !average_; }

  // True when `layout` and `optimizer` equal this group's (idempotent registration).
  bool SameSpec(const FlatLayout& layout, const OptimizerConfig& optimizer) const;

  // Ends every wait with `why` (not OK), and refuses gathers, scatters, exchanges and
  // loads (Restore) with it from now on: its job was deleted (NotFound), or the server is
  // shutting down (Unavailable). For the Registry; the group stays closed (a second Close
  // keeps the first reason).
  void Close(absl::Status why);

  int64_t version() const;
  // The version and the load of the state it holds now.
  StateStamp state() const;
  // Blocks until version() >= min_version or `deadline`; returns the version, or
  // DeadlineExceeded naming both versions. Aborted, at once, when a load (Restore) moves
  // the group below min_version while it waits: the load dropped the contributions to
  // the step in progress, so that version comes only once workers send them again.
  // Cancelled once `caller_gone` (optional, server/caller_wait.h) says the request's
  // caller went away.
  [[nodiscard]] absl::StatusOr<int64_t> WaitVersion(int64_t min_version, absl::Time deadline,
                                                    const CallerGone& caller_gone = nullptr) const;

  // Waits like WaitVersion, then returns the shard at the current version in `dtype`.
  [[nodiscard]] absl::StatusOr<GatherSnapshot> Gather(int64_t min_version, DType dtype, absl::Time deadline,
                                                      const CallerGone& caller_gone = nullptr);
  // InvalidArgument naming `plane` ("CUDA IPC") unless `bytes` is this server's shard in
  // `dtype`: what a transfer that names its size must name.
  [[nodiscard]] absl::Status CheckShardBytes(DType dtype, uint64_t bytes,
                                             absl::string_view plane) const;
  // Device groups: waits like Gather, then writes the shard in `dtype` straight into
  // `device_dst` (shard_numel elements) and returns the state written.
  // FailedPrecondition for a group that is not in device memory.
  [[nodiscard]] absl::StatusOr<StateStamp> GatherInto(int64_t min_version, DType dtype, void* device_dst,
                                                      absl::Time deadline, const CallerGone& caller_gone = nullptr);

  // Reserves the slot for `worker_rank`'s gradient for `step`, or for `part` of it,
  // computed from the parameters of checkpoint load `from_load` (nullopt: not known).
  // Aborted when the group holds another load's state; then AlreadyExists for a
  // contribution already held or applied (duplicate, stale; async: not newer than the
  // worker's last), FailedPrecondition for a future one, one (or this part of one)
  // already being received, or one beyond the staleness bound, InvalidArgument for a
  // worker rank outside [0, W) or of another replica group, a non-float dtype, or a part
  // that SplitRanges does not make of this slot (parts are host memory only).
  // FailedPrecondition for SlotMemory::kDevice on a group that is not in device memory.
  [[nodiscard]] absl::StatusOr<ReceiveSlot> BeginScatter(int64_t step, int worker_rank, DType dtype,
                                                         SlotMemory memory = SlotMemory::kHost, SlotPart part = {},
                                                         std::optional<uint64_t> from_load = std::nullopt);
  // The bytes {offset, size} of a `dtype` contribution that `part` carries;
  // InvalidArgument naming the part when SplitRanges does not make it of this slot.
  [[nodiscard]] absl::StatusOr<std::pair<size_t, size_t>> PartRange(DType dtype, SlotPart part) const;
  // After BeginScatter or BeginExchange refused `step` with FailedPrecondition: decides,
  // atomically with the state it reads, whether to try again. True when this server has
  // reached `step` since (try again) or reaches it by `deadline`, having waited because
  // the contribution was early, not wrong: sync mode, `step` is the next step and this
  // server holds every contribution to the current one, so only peers (the exchange
  // between replica groups, the norm) keep it from finishing; also true when a load
  // (Restore) ends the wait. False when the refusal stands; DeadlineExceeded when the
  // wait ran out.
  [[nodiscard]] absl::StatusOr<bool> AwaitEarlyStep(int64_t step, absl::Time deadline) const;
  // Device slots: copies slot.buffer.size() bytes from `device_src` (device memory of
  // any process mapped here) into the slot.
  [[nodiscard]] absl::Status FillDeviceSlot(const ReceiveSlot& slot, const void* device_src);
  // Records the filled slot (kPending while other parts of it are to come); the last
  // contribution of a step reduces and (without clipping) runs the optimizer before
  // returning (hybrid: sums the replica's partial). Aborted when a load (Restore) dropped
  // the contribution since BeginScatter.
  [[nodiscard]] absl::StatusOr<CommitOutcome> CommitScatter(const ReceiveSlot& slot);

  // Hybrid jobs (the exchange in the header comment). Chunk `replica` of this shard:
  // {offset, numel} in elements; offsets are multiples of 4 (16 bytes).
  std::pair<int64_t, int64_t> ReplicaChunk(int replica) const;
  // The chunk a `what` from replica group `replica` carries: this server's for kPartial,
  // the sender's for kReduced.
  std::pair<int64_t, int64_t> ExchangeChunk(Exchange what, int replica) const {
    return ReplicaChunk(what == Exchange::kPartial ? placement_.replica : replica);
  }
  // After kShare: this replica's partial for `step` (the whole shard);
  // FailedPrecondition when it is not summed yet or already delivered. CommitOwnPartial
  // then counts it once every chunk reached its owner.
  [[nodiscard]] absl::StatusOr<OutgoingChunk> SharedPartial(int64_t step) const;
  [[nodiscard]] absl::StatusOr<CommitOutcome> CommitOwnPartial(const ExchangeRound& round);
  // After kBroadcast: this server's reduced chunk for `step`. CommitBroadcast then
  // counts it once every other replica group holds it.
  [[nodiscard]] absl::StatusOr<OutgoingChunk> BroadcastChunk(int64_t step) const;
  [[nodiscard]] absl::StatusOr<CommitOutcome> CommitBroadcast(const ExchangeRound& round);
  // kShare and kBroadcast hand what is to be sent to one caller. If sending fails,
  // ReleasePending lets a later ClaimPending (which returns each at most once per
  // release) take it up again. A release of a round the group has left is ignored.
  void ReleasePending(const ExchangeRound& round, CommitOutcome what);
  std::optional<CommitOutcome> ClaimPending(int64_t step);
  // Which replica groups' servers hold `what` (kShare: their chunk of this replica's
  // partial; kBroadcast: this server's reduced chunk) in `round`, as the sender recorded
  // with MarkDelivered: a send after a failure goes to the others only. Cleared when the
  // step moves on or a load resets the exchange; marks of another round are ignored, as
  // are replicas outside [0, R).
  void MarkDelivered(const ExchangeRound& round, CommitOutcome what, int replica);
  bool Delivered(const ExchangeRound& round, CommitOutcome what, int replica) const;
  // What another replica group's server sends in `round` (slot.worker_rank = its replica
  // group, fp32, its chunk's size). AlreadyExists for one already held or applied;
  // FailedPrecondition for a future step, one being received or a frozen group;
  // InvalidArgument for a replica group outside [0, R) or this one's; Aborted for a
  // round of a state a load replaced here; Unavailable for one of a load this server has
  // not committed yet (AwaitLoad). Committing the last kPartial returns kBroadcast, the
  // last kReduced what the last contribution would; a commit after a load since
  // BeginExchange is Aborted.
  [[nodiscard]] absl::StatusOr<ReceiveSlot> BeginExchange(Exchange what, const ExchangeRound& round, int replica);
  [[nodiscard]] absl::StatusOr<CommitOutcome> CommitExchange(Exchange what, const ReceiveSlot& slot);
  void AbortExchange(Exchange what, const ReceiveSlot& slot);
  // After BeginExchange refused a round with Unavailable: true once this group has
  // committed load `load_epoch` (now or by `deadline`) or is closed (BeginExchange then
  // says so), false when the wait ran out.
  bool AwaitLoad(uint64_t load_epoch, absl::Time deadline) const;

  // Clipped jobs. True when the contributions for `step` are reduced and wait for the
  // norm. NormPartial: this shard's sum of squares (norm_type 2) or max |g| (inf) of the
  // reduced gradient; precondition: reduced_at(version()).
  bool reduced_at(int64_t step) const;
  [[nodiscard]] absl::StatusOr<double> NormPartial(double norm_type) const;
  // Scales the reduced gradient by clip_coef when it is below 1 (or NaN, as torch
  // does), runs the optimizer and publishes step + 1. FailedPrecondition unless
  // reduced_at(step).
  [[nodiscard]] absl::Status FinishClippedStep(int64_t step, float clip_coef);
  // A job with skip_nonfinite whose norm came out inf or NaN: publishes step + 1 without
  // an optimizer step (parameters and optimizer state stay). FailedPrecondition unless
  // reduced_at(step).
  [[nodiscard]] absl::Status SkipStep(int64_t step);
  void AbortScatter(const ReceiveSlot& slot);

  // Initial values: a slot for this server's shard (shard_numel elements of `dtype`).
  // FailedPrecondition once the group has stepped (version > 0).
  [[nodiscard]] absl::StatusOr<ReceiveSlot> BeginPushInit(DType dtype);
  [[nodiscard]] absl::Status CommitPushInit(const ReceiveSlot& slot);
  void AbortPushInit(const ReceiveSlot& slot);

  // Deterministic initialization: element k of tensor t gets a value derived from
  // (seed, t's name, k) only, uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)); the same on
  // any number of servers. FailedPrecondition once the group has stepped.
  [[nodiscard]] absl::Status InitFromSeed(uint64_t seed);

  // Waits until version() == version (up to `deadline`) and copies the shard.
  // FailedPrecondition if the group is already past `version`, or a load moves it below
  // `version` while it waits; DeadlineExceeded.
  [[nodiscard]] absl::StatusOr<ShardSnapshot> Snapshot(int64_t version, absl::Time deadline) const;
  // Holds the group at `version` without copying it (exports): the metadata of a
  // Snapshot with empty value vectors (state names kept), after which the optimizer step
  // that would leave `version`, loads and re-initialization wait until Unpin(). Values
  // are read with ReadPinned. FailedPrecondition and DeadlineExceeded as for Snapshot.
  // Every successful Pin must be matched by one Unpin.
  [[nodiscard]] absl::StatusOr<ShardSnapshot> Pin(int64_t version, absl::Time deadline);
  void Unpin();
  // Until ReleaseHold(version), the optimizer step that would leave `version` waits (a
  // step that would reach it does not): a save or export that pins several groups holds
  // them all at its cut first, so that none steps past the cut while it waits for another
  // to reach it. Loads and re-initialization do not wait for holds. Every HoldAt must be
  // matched by one ReleaseHold of the same version.
  void HoldAt(int64_t version);
  void ReleaseHold(int64_t version);
  // `count` fp32 elements of the parameters (`state` empty) or of optimizer state `state`,
  // from element `offset` of this server's shard, into `out`. Precondition: pinned.
  [[nodiscard]] absl::Status ReadPinned(absl::string_view state, int64_t offset, int64_t count,
                                        float* out) const;

  // Installs a loaded shard (checkpoint load `load_id`: non-zero, the same on every
  // server, a new one per load): parameters, optimizer state and version; contributions
  // in flight for the old version are dropped, and the exchange starts a round of
  // `load_id`. On the host tier the buffers are adopted (no copy; the old ones are
  // freed), on the others copied. What `kept` names stays as it is: the group's current
  // values are copied into `loaded` first, under the lock that installs it.
  // InvalidArgument (nothing changed) if sizes or state names do not match this group
  // or a kept range lies outside the shard.
  [[nodiscard]] absl::Status Restore(LoadedShard loaded, uint64_t load_id, const KeptState& kept = {});
  std::vector<std::string> optimizer_state_names() const;

  // New hyper-parameters from the next step on (same optimizer kind).
  [[nodiscard]] absl::Status SetOptimizer(const OptimizerConfig& optimizer);
  // What SetOptimizer would refuse before it changes anything: settings out of range
  // (InvalidArgument) or another optimizer kind (FailedPrecondition).
  [[nodiscard]] absl::Status CheckOptimizer(const OptimizerConfig& optimizer) const;

  GroupStats stats() const;
  // Durations of this group's steps on this server (GroupStatus.reduce_seconds and
  // optimizer_seconds): reducing the contributions, running the optimizer.
  const LatencyHistogram& reduce_latency() const { return reduce_latency_; }
  const LatencyHistogram& optimizer_latency() const { return optimizer_latency_; }

 private:
  enum class SlotState { kEmpty, kReceiving, kReady };

  // One worker's contribution to the current step (async: to the step it names).
  struct Contribution {
    SlotState state = SlotState::kEmpty;
    DType dtype = DType::kFloat32;
    void* data = nullptr;  // the worker's staging_ or device_staging_
    // kReceiving: the step and the number of parts it comes in; bit k of `in_flight`
    // (`arrived`): part k is being received (has landed).
    int64_t step = 0;
    int parts = 1;
    uint64_t in_flight = 0;
    uint64_t arrived = 0;

    bool complete() const { return arrived == ~uint64_t{0} >> (64 - parts); }  // parts in [1, 64]
  };

  Group(std::string job, std::string name, FlatLayout layout, Placement placement, JobSettings job_settings,
        std::unique_ptr<ShardCompute> compute, ShardBuffer params, ShardBuffer grad,
        ShardOptimizer optimizer);

  // The group state checkpoint load `load_id` installed, for messages: "the state of
  // checkpoint load 5f3a..." (0: "the state from before any checkpoint load").
  static std::string LoadedState(uint64_t load_id);

  // Blocks (releasing mu_) until version_ >= min_version (true), a load (Restore) moves
  // the group below it (false), `deadline` (DeadlineExceeded naming both versions) or
  // `caller_gone` says so (Cancelled).
  absl::StatusOr<bool> AwaitVersion(int64_t min_version, absl::Time deadline,
                                    const CallerGone& caller_gone = nullptr) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AwaitVersion for gathers (Aborted when loaded below min_version) and for the cut of a
  // save or export (FailedPrecondition: the load replaced the state it was cut from).
  absl::Status AwaitGatherVersion(int64_t min_version, absl::Time deadline,
                                  const CallerGone& caller_gone = nullptr) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AwaitCut(int64_t version, absl::Time deadline) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckContribution(int64_t step, int worker_rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Close's reason once the group is closed; OK before.
  absl::Status CheckOpen() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_; }
  // The contribution `slot` reserved a part of, if that part is still in flight there.
  Contribution* Reserved(const ReceiveSlot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckDeviceTier(absl::string_view what) const;
  absl::Status ReduceContributions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hybrid: this replica's contributions, summed in worker-rank order into its partial.
  absl::Status ReduceOwnPartial() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hybrid: after replica group `replica`'s partial of this server's chunk was counted;
  // the last adds all R into the chunk (kBroadcast).
  absl::StatusOr<CommitOutcome> PartialArrived(int replica) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hybrid: after chunk `replica` of the reduced gradient was counted; the last copies
  // them into grad_ and goes on with the step (clipping or optimizer).
  absl::StatusOr<CommitOutcome> ReducedArrived(int replica) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static bool AllReady(const std::vector<SlotState>& states);
  // Hybrid: OK when this server's own `what` for `round` waits to be sent (kReceiving);
  // FailedPrecondition naming it otherwise.
  absl::Status CheckOutgoing(Exchange what, const ExchangeRound& round) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hybrid: where the exchange assembles the reduced gradient (host-addressable, the whole
  // shard): grad_ itself on the host and pinned tiers, reduced_staging_ (copied into
  // grad_ once complete) on the device tier. EnsureReducedGradient allocates the staging.
  absl::Status EnsureReducedGradient() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Span<std::byte> ReducedGradient() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<SlotState>& ExchangeStates(Exchange what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return what == Exchange::kPartial ? partial_states_ : reduced_states_;
  }
  // After the reduction into grad_: kReduced for a clipped job, else the optimizer step.
  absl::StatusOr<CommitOutcome> FinishReduction() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Zeroes grad_ at the shard's padding, whatever the workers sent there: padding never
  // counts in norms or optimizer results (DESIGN.md, flat layout rule 5).
  absl::Status ZeroGradientPadding() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the sum of the contributions is multiplied by: 1/W for a mean (the job's reduce,
  // or always for an average group), else 1.
  float ReduceAlpha() const;
  absl::Status StepOptimizer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // version + 1, slots free for the next step, snapshots of the new version.
  void AdvanceVersion() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hybrid: the exchange's states back to empty, nothing claimed.
  void ResetExchange() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The exchange is in `round`: at its step, with the state of its load.
  bool InRound(const ExchangeRound& round) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return version_ == round.step && load_epoch_ == round.load_epoch;
  }
  absl::StatusOr<CommitOutcome> CommitAsync(const ReceiveSlot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishNewValues() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A buffer of at least `bytes` (host-addressable, or in the tier for `memory` kDevice),
  // reallocated when smaller.
  absl::Status EnsureStaging(ShardBuffer& buffer, size_t bytes, absl::string_view what,
                             SlotMemory memory = SlotMemory::kHost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `host_shard` (shard_numel() values, its padding zeroed here, whatever it held)
  // into params_.
  absl::Status WriteTensorElements(absl::Span<float> host_shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks (releasing mu_) while an export holds the group pinned.
  void AwaitUnpinned() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks (releasing mu_) while the group is pinned or held at its version (HoldAt):
  // before a step leaves it.
  void AwaitStepAllowed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string job_;
  const std::string name_;
  const FlatLayout layout_;
  const Placement placement_;
  const JobSettings job_settings_;
  const int replica_workers_;  // contributions per step here: W, or this replica's share
  const std::vector<std::pair<int64_t, int64_t>> padding_runs_;  // {offset, count} in the shard
  LatencyHistogram reduce_latency_;
  LatencyHistogram optimizer_latency_;

  mutable absl::Mutex mu_;
  // Kernels and memory of the tier; calls are serialized by mu_.
  const std::unique_ptr<ShardCompute> compute_;
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  ShardBuffer params_ ABSL_GUARDED_BY(mu_);  // fp32 master shard
  ShardBuffer grad_ ABSL_GUARDED_BY(mu_);    // reduced gradient of the step; empty if frozen
  ShardOptimizer optimizer_ ABSL_GUARDED_BY(mu_);
  const bool frozen_;
  const bool average_;
  std::vector<Contribution> contributions_ ABSL_GUARDED_BY(mu_);  // per worker
  // One staging buffer per worker; a part in flight is written without the lock by the
  // one connection that reserved it. A ready slot may trade places with grad_ under the
  // lock (ReduceContributions).
  std::vector<ShardBuffer> staging_;
  std::vector<ShardBuffer> device_staging_;  // CUDA IPC contributions (device groups)
  std::shared_ptr<SnapshotPool> snapshot_pool_;
  int ready_count_ ABSL_GUARDED_BY(mu_) = 0;
  // Hybrid exchange, indexed by replica group q (a slot in kReceiving is written without
  // the lock by its one receiver; all return to kEmpty when the version advances):
  //  - partial_states_[q], q != this replica: q's partial of this server's chunk, in
  //    partial_chunks_[q]. [this replica]: its own partial (own_partial_, the whole
  //    shard), kReceiving from its sum until every chunk reached its owner, then kReady.
  //  - reduced_states_[q], q != this replica: chunk q as its owner reduced it, in
  //    ReducedGradient(). [this replica]: this server's chunk, reduced there, kReceiving
  //    until every other replica group holds it, then kReady.
  std::vector<SlotState> partial_states_ ABSL_GUARDED_BY(mu_);
  std::vector<SlotState> reduced_states_ ABSL_GUARDED_BY(mu_);
  ShardBuffer own_partial_;
  std::vector<ShardBuffer> partial_chunks_;
  ShardBuffer reduced_staging_;
  bool share_claimed_ ABSL_GUARDED_BY(mu_) = false;      // own_partial_ is being shared
  bool broadcast_claimed_ ABSL_GUARDED_BY(mu_) = false;  // this chunk is being broadcast
  // By replica group: it holds this replica's share (this server's broadcast).
  std::vector<bool> share_delivered_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> broadcast_delivered_ ABSL_GUARDED_BY(mu_);
  int pins_ ABSL_GUARDED_BY(mu_) = 0;  // exports reading the live shard
  std::multiset<int64_t> holds_ ABSL_GUARDED_BY(mu_);  // HoldAt's versions
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped by loads and re-initialization
  absl::Status closed_ ABSL_GUARDED_BY(mu_);     // Close's reason; OK while open
  int64_t loads_ ABSL_GUARDED_BY(mu_) = 0;       // Restore calls that installed a shard
  uint64_t load_epoch_ ABSL_GUARDED_BY(mu_) = 0;              // the last Restore's load id (0: none)
  std::set<uint64_t> left_load_epochs_ ABSL_GUARDED_BY(mu_);  // those before it
  bool reduced_ ABSL_GUARDED_BY(mu_) = false;  // clipped: grad_ holds step version_
  std::vector<int64_t> last_async_step_ ABSL_GUARDED_BY(mu_);  // per worker, -1: none
  bool init_receiving_ ABSL_GUARDED_BY(mu_) = false;
  // Written without the lock by the one connection that set init_receiving_; freed when
  // the push ends (a group is initialized once, or a few times before its first step).
  ShardBuffer init_staging_;
  // Gather snapshots of the current version, per dtype (index = DType).
  std::shared_ptr<const ShardBuffer> snapshots_[3] ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_GROUP_H_
