// Internal to server/: the CUDA side of ShardCompute (server/shard_compute.h), compiled
// only in builds with CUDA (FLATSHARD_HAVE_CUDA).
#ifndef FLATSHARD_SERVER_CUDA_SHARD_COMPUTE_H_
#define FLATSHARD_SERVER_CUDA_SHARD_COMPUTE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/shard_compute.h"

namespace flatshard::server::internal {

// OK when this machine has a CUDA device; FailedPrecondition saying why not otherwise.
[[nodiscard]] absl::Status CheckCudaDevice();
// Pinned host memory (cudaHostAlloc), addressable by kernels, not yet written.
[[nodiscard]] absl::StatusOr<ShardBuffer> AllocatePinnedUnwritten(size_t bytes, absl::string_view what);
// The same, zero-filled.
[[nodiscard]] absl::StatusOr<ShardBuffer> AllocatePinned(size_t bytes, absl::string_view what);
// The device tier, with its own stream on the current device.
[[nodiscard]] absl::StatusOr<std::unique_ptr<ShardCompute>> MakeCudaShardCompute();

}  // namespace flatshard::server::internal

#endif  // FLATSHARD_SERVER_CUDA_SHARD_COMPUTE_H_
