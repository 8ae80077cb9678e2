// ShardCompute: where a group's shard lives (the server's --memory tier) and the kernels
// that run on it. Two implementations:
//   host, pinned  parameters, gradients and optimizer state in host memory (pinned:
//                 cudaHostAlloc, FSDP's CPU offload with pin_memory); CPU kernels on
//                 the server's threads (server/compute_pool.h).
//   device        the same in GPU memory (cudaMalloc); CUDA kernels on the group's own
//                 stream, so groups run concurrently. Staging slots and gather snapshots
//                 are pinned host memory that the kernels read and write directly (no
//                 separate copy).
// Kernels are enqueued in order; Synchronize() waits for all of them, and a caller must
// call it before the host touches memory a kernel writes or before it reuses memory a
// kernel reads. CPU kernels complete before returning. Results are bit for bit the same
// on every tier (shared element code; kernels/cuda/kernels.h).
// Not thread-safe: one Group owns one ShardCompute and serializes calls.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto compute, MakeShardCompute(MemoryTier::kDevice));
//   FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer grad, compute->AllocateShard(bytes, "grad"));
#ifndef FLATSHARD_SERVER_SHARD_COMPUTE_H_
#define FLATSHARD_SERVER_SHARD_COMPUTE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "absl/types/span.h"
#include "kernels/contribution.h"
#include "kernels/hyperparams.h"
#include "server/compute_pool.h"
#include "server/shard_buffer.h"

namespace flatshard::server {

enum class MemoryTier { kHost, kPinned, kDevice };

// "host", "pinned" or "device" -> the tier; InvalidArgument otherwise. Pinned and device
// are FailedPrecondition in a build without CUDA or on a machine without a CUDA device.
[[nodiscard]] absl::StatusOr<MemoryTier> ParseMemoryTier(absl::string_view name);
absl::string_view MemoryTierName(MemoryTier tier);

// Host heap memory left unwritten, for a buffer filled whole before use (a checkpoint
// load's staging). Laid out and freed as the host tier's shards are (large buffers
// 2 MiB-aligned, on huge pages), so that a host-tier group can adopt it instead of
// copying it (Group::Restore). ResourceExhausted naming `what` and the bytes.
[[nodiscard]] absl::StatusOr<ShardBuffer> AllocateHostUnwritten(size_t bytes, absl::string_view what);

class ShardCompute {
 public:
  virtual ~ShardCompute() = default;

  virtual MemoryTier tier() const = 0;

  // Zero-filled memory for parameters, gradients and optimizer state, in the tier.
  // ResourceExhausted naming `what` and the bytes when the tier cannot hold it.
  [[nodiscard]] virtual absl::StatusOr<ShardBuffer> AllocateShard(size_t bytes,
                                                                  absl::string_view what) = 0;
  // Host-addressable memory the kernels also reach: staging slots, gather snapshots.
  [[nodiscard]] virtual absl::StatusOr<ShardBuffer> AllocateStaging(size_t bytes,
                                                                    absl::string_view what) = 0;

  // The kernel families of kernels/kernels.h on this tier's memory.
  [[nodiscard]] virtual absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype,
                                          void* dst, int64_t numel) = 0;
  // dst = alpha * (sum of the contributions in order), one pass (kernels/cpu/reduce.h).
  [[nodiscard]] virtual absl::Status Reduce(absl::Span<const kernels::Contribution> contributions,
                                            float* dst, int64_t numel, float alpha) = 0;
  [[nodiscard]] virtual absl::Status Scale(float* x, int64_t numel, float alpha) = 0;
  [[nodiscard]] virtual absl::Status SgdStep(const kernels::SgdHyperparams& hp, bool first_step,
                                             float* param, const float* grad,
                                             float* momentum_buffer, int64_t numel) = 0;
  [[nodiscard]] virtual absl::Status AdamStep(const kernels::AdamHyperparams& hp, int64_t step,
                                              float* param, const float* grad, float* exp_avg,
                                              float* exp_avg_sq, float* max_exp_avg_sq,
                                              int64_t numel) = 0;
  // Sum of squares (norm_type 2) or max |x| (inf) of shard memory; waits for the result.
  [[nodiscard]] virtual absl::StatusOr<double> NormPartial(const float* x, int64_t numel,
                                                           double norm_type) = 0;

  // Copies between shard memory and plain host memory; both wait until done.
  [[nodiscard]] virtual absl::Status CopyToHost(const float* shard, float* host, int64_t numel) = 0;
  [[nodiscard]] virtual absl::Status CopyFromHost(const float* host, float* shard, int64_t numel) = 0;
  [[nodiscard]] virtual absl::Status Zero(float* shard, int64_t numel) = 0;
  // Enqueues a copy of `bytes` between any two buffers this tier's kernels can address.
  [[nodiscard]] virtual absl::Status CopyBytes(void* dst, const void* src, size_t bytes) = 0;

  // Waits for every kernel enqueued so far.
  [[nodiscard]] virtual absl::Status Synchronize() = 0;
};

// The ShardCompute of `tier`; FailedPrecondition as ParseMemoryTier says. The CPU tiers
// run their kernels on `pool` (null: on the calling thread); the device tier ignores it.
[[nodiscard]] absl::StatusOr<std::unique_ptr<ShardCompute>> MakeShardCompute(
    MemoryTier tier, std::shared_ptr<const ComputePool> pool = nullptr);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SHARD_COMPUTE_H_
