#include "core/checkpoint_kind.h"

#include "absl/strings/str_cat.h"

namespace flatshard {

absl::string_view CheckpointKindName(CheckpointKind kind) {
  switch (kind) {
    case CheckpointKind::kFull:
      return "full";
    case CheckpointKind::kSharded:
      return "sharded";
    case CheckpointKind::kLocal:
      return "local";
  }
  return "?";
}

absl::StatusOr<CheckpointKind> ParseCheckpointKind(absl::string_view name) {
  for (CheckpointKind kind : {CheckpointKind::kFull, CheckpointKind::kSharded, CheckpointKind::kLocal}) {
    if (name == CheckpointKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("checkpoint kind '", name, "': expected full, sharded or local"));
}

}  // namespace flatshard
