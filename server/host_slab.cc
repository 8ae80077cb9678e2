#include "server/host_slab.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/shard_compute.h"

namespace flatshard::server {
namespace {

void UnmapBlock(void* block) { munmap(block, HostSlab::kBlockBytes); }

}  // namespace

absl::StatusOr<ShardBuffer> HostSlab::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return ShardBuffer();
  if (!Carves(bytes)) return AllocateHostUnwritten(bytes, what);
  const size_t rounded = (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  if (block_ == nullptr || kBlockBytes - used_ < rounded) {
    // Not checked against the host's free memory, as no buffer under 16 MiB ever was
    // (AllocateHostUnwritten): not worth reading /proc for.
    void* block = mmap(nullptr, kBlockBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (block == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("mapping ", kBlockBytes, " bytes of host memory for ", what,
                                                       " failed: ", std::strerror(errno)));
    }
    std::memset(block, 0, kBlockBytes);  // zero already: the write backs it (the header says why)
    block_ = std::make_shared<ShardBuffer>(block, kBlockBytes, &UnmapBlock);
    used_ = 0;
  }
  std::byte* piece = block_->bytes().data() + used_;
  used_ += rounded;
  return ShardBuffer(piece, bytes, std::shared_ptr<const void>(block_, piece));
}

}  // namespace flatshard::server
