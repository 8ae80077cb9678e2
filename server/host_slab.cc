#include "server/host_slab.h"

#include <utility>

#include "core/status_macros.h"
#include "server/shard_compute.h"

namespace flatshard::server {

absl::StatusOr<ShardBuffer> HostSlab::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return ShardBuffer();
  if (bytes >= kMaxPieceBytes) return AllocateHostUnwritten(bytes, what);
  const size_t rounded = (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  if (block_ == nullptr || kBlockBytes - used_ < rounded) {
    FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer block, AllocateHostUnwritten(kBlockBytes, what));
    block_ = std::make_shared<ShardBuffer>(std::move(block));
    used_ = 0;
  }
  std::byte* piece = block_->bytes().data() + used_;
  used_ += rounded;
  return ShardBuffer(piece, bytes, std::shared_ptr<const void>(block_, piece));
}

}  // namespace flatshard::server
