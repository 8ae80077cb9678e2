#include "server/host_slab.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/shard_compute.h"

namespace flatshard::server {
namespace {

void FreeBlock(void* block) { std::free(block); }

}  // namespace

absl::StatusOr<ShardBuffer> HostSlab::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return ShardBuffer();
  if (bytes >= kMaxPieceBytes) return AllocateHostUnwritten(bytes, what);
  const size_t rounded = (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  if (block_ == nullptr || kBlockBytes - used_ < rounded) {
    // Not checked against the host's free memory, as no buffer under 16 MiB ever was
    // (AllocateHostUnwritten): not worth reading /proc for.
    void* block = std::aligned_alloc(kPieceAlign, kBlockBytes);
    if (block == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("allocating ", kBlockBytes, " bytes of host memory for ", what, " failed"));
    }
    block_ = std::make_shared<ShardBuffer>(block, kBlockBytes, &FreeBlock);
    used_ = 0;
  }
  std::byte* piece = block_->bytes().data() + used_;
  used_ += rounded;
  return ShardBuffer(piece, bytes, std::shared_ptr<const void>(block_, piece));
}

}  // namespace flatshard::server
