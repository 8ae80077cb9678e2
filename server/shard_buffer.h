// ShardBuffer: bytes of one memory tier (host heap, pinned host or GPU device memory)
// owned together with the function that frees them (core/owned_buffer.h). Made by
// ShardCompute (server/shard_compute.h), which knows the tier; the buffer itself only
// frees. bytes() is only for host-addressable tiers (host, pinned, and staging of every
// tier). Not synchronized: its owner (a Group) serializes access.
//
//   absl::StatusOr<ShardBuffer> params = compute.AllocateShard(bytes, "group 'mlp' parameters");
//   float* p = params->floats();
#ifndef FLATSHARD_SERVER_SHARD_BUFFER_H_
#define FLATSHARD_SERVER_SHARD_BUFFER_H_

#include "core/owned_buffer.h"

namespace flatshard::server {

using ShardBuffer = OwnedBuffer;

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SHARD_BUFFER_H_
