// HostSlab: small host buffers carved one after another out of shared blocks, for a load
// that stages many small groups at once (server/checkpoint_loader.h). A malloc per
// buffer cost an mprotect each in a gRPC thread's arena (glibc grows those heaps by just
// what each allocation needs): 150000 for a load of 20000 groups on 2 servers. A block is
// one kPieceAlign-aligned allocation of kBlockBytes, not advised for huge pages (on a
// host whose memory is fragmented, finding huge pages cost more than the faults they
// save here). Each buffer keeps its block alive (OwnedBuffer's shared block),
// so a block is freed with the last of its buffers, which a job's groups drop together
// at its next load or deletion. Buffers of kMaxPieceBytes or more are allocated on their
// own. Not thread-safe: one stager uses one slab; the buffers it gives are independent of
// it and of each other.
//
//   HostSlab slab;
//   FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer params, slab.Allocate(bytes, "loading group 'g'"));
#ifndef FLATSHARD_SERVER_HOST_SLAB_H_
#define FLATSHARD_SERVER_HOST_SLAB_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/shard_buffer.h"

namespace flatshard::server {

class HostSlab {
 public:
  static constexpr size_t kBlockBytes = size_t{4} << 20;
  static constexpr size_t kMaxPieceBytes = size_t{1} << 20;
  static constexpr size_t kPieceAlign = 64;  // a cache line; AVX-512 loads

  // `bytes` of unwritten host memory, kPieceAlign-aligned (an empty buffer for 0), as
  // AllocateHostUnwritten gives them: ResourceExhausted naming `what` when they cannot be
  // had.
  [[nodiscard]] absl::StatusOr<ShardBuffer> Allocate(size_t bytes, absl::string_view what);

 private:
  std::shared_ptr<ShardBuffer> block_;  // the block being carved; null before the first
  size_t used_ = 0;                     // bytes of it given out (rounded to kPieceAlign)
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_HOST_SLAB_H_
