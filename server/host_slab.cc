#include "server/host_slab.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/shard_compute.h"

namespace flatshard::server {

absl::StatusOr<ShardBuffer> HostSlab::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return ShardBuffer();
  if (!Carves(bytes)) return AllocateHostUnwritten(bytes, what);
  const size_t rounded = (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  if (block_ == nullptr || block_bytes_ - used_ < rounded) {
    // Not checked against the host's free memory, as no buffer under 16 MiB ever was
    // (AllocateHostUnwritten): not worth reading /proc for.
    const size_t next = block_ == nullptr ? kFirstBlockBytes : std::min(2 * block_bytes_, kBlockBytes);
    const size_t size = std::max(next, rounded);  // mmap and munmap take it in whole pages
    void* block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (block == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mapping ", size, " bytes of host memory for ", what, " failed: ", std::strerror(errno)));
    }
    std::memset(block, 0, size);  // zero already: the write backs it (the header says why)
    block_ = std::shared_ptr<std::byte>(static_cast<std::byte*>(block), [size](std::byte* b) { munmap(b, size); });
    block_bytes_ = size;
    used_ = 0;
    mapped_bytes_ += size;
  }
  std::byte* piece = block_.get() + used_;
  used_ += rounded;
  return ShardBuffer(piece, bytes, std::shared_ptr<const void>(block_, piece));
}

}  // namespace flatshard::server
