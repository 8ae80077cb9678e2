// The three checkpoint kinds (DESIGN.md "Checkpoints"), shared by the server, the client
// and its tools, with their names as the CLI, Python and manifests spell them. Pure
// functions; thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(CheckpointKind kind, ParseCheckpointKind("sharded"));
//   std::cout << CheckpointKindName(kind);  // "sharded"
#ifndef FLATSHARD_CORE_CHECKPOINT_KIND_H_
#define FLATSHARD_CORE_CHECKPOINT_KIND_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

// FULL: safetensors by tensor name (loadable by PyTorch), any server count on load.
// SHARDED: each server's pieces of the original tensors, any server count on load.
// LOCAL: each server's flat shard as it is; same server count and layout on load.
enum class CheckpointKind { kFull, kSharded, kLocal };

// "full", "sharded" or "local".
absl::string_view CheckpointKindName(CheckpointKind kind);
// The kind named so; InvalidArgument naming the text otherwise.
[[nodiscard]] absl::StatusOr<CheckpointKind> ParseCheckpointKind(absl::string_view name);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_CHECKPOINT_KIND_H_
