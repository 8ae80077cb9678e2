// HostSlab: small host buffers carved one after another out of shared blocks, for calls
// that make many small groups' buffers at once: a load staging them
// (server/checkpoint_loader.h) and a registration (Registry::RegisterGroups). A malloc
// per buffer cost an mprotect each in a gRPC thread's arena (glibc grows those heaps by
// just what each allocation needs): 150000 for a load of 20000 groups on 2 servers. A
// block is a fresh anonymous mapping, populated when it is made (the kernel maps all its
// pages in that one call rather than taking a fault per page) and then written once,
// zeros, so that its memory is taken and backed before the call that carves it answers
// (on a VM, a populated page's first write can still cost the host a fault: a step or a
// save would pay it later); its pieces are zero-filled. The first block is
// kFirstBlockBytes (or the first piece), each next one twice the last, up to kBlockBytes,
// so that a slab that carves little maps little. Blocks are not advised for huge pages
// (on a host whose memory is fragmented, finding huge pages cost more than the faults
// they save).
// Each buffer keeps its block alive (OwnedBuffer's shared block), so a block is unmapped
// with the last of its buffers, which a job's groups drop together at its next load or
// deletion. Buffers of kMaxPieceBytes or more are allocated on their own
// (AllocateHostUnwritten: not zeroed). Not thread-safe: one caller uses one slab; the
// buffers it gives are independent of it and of each other.
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
  static constexpr size_t kFirstBlockBytes = size_t{64} << 10;
  static constexpr size_t kBlockBytes = size_t{4} << 20;  // the largest block
  static constexpr size_t kMaxPieceBytes = size_t{1} << 20;
  static constexpr size_t kPieceAlign = 64;  // a cache line; AVX-512 loads

  // `bytes` of host memory, kPieceAlign-aligned (an empty buffer for 0): zero-filled when
  // Carves(bytes), else unwritten, as AllocateHostUnwritten gives them. ResourceExhausted
  // naming `what` when they cannot be had.
  [[nodiscard]] absl::StatusOr<ShardBuffer> Allocate(size_t bytes, absl::string_view what);

  // Whether a buffer of `bytes` is a piece of a block (so zero-filled), not one of its own.
  static bool Carves(size_t bytes) { return bytes > 0 && bytes < kMaxPieceBytes; }

  // The bytes of every block this slab has mapped.
  size_t mapped_bytes() const { return mapped_bytes_; }

 private:
  std::shared_ptr<std::byte> block_;  // the block being carved (unmapped with its last piece); null before the first
  size_t block_bytes_ = 0;            // its size
  size_t used_ = 0;                   // bytes of it given out (rounded to kPieceAlign)
  size_t mapped_bytes_ = 0;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_HOST_SLAB_H_
