// Checkpoint imports (ImportCheckpoint, proto/flatshard.proto): a state dict brought from
// a client's disk into server 0's root, as the files of a checkpoint whose manifest server
// 0 writes. The files (names as core/state_dict_files.h gives them) are a FULL state dict,
// what a FULL export writes or what PyTorch and Hugging Face tools write:
// model.safetensors, or model.safetensors.index.json and the split files its weight_map
// names; optionally the optimizer's likewise. Or a SHARDED export's shard files, which
// become a SHARDED checkpoint (below). What the manifest says of FULL files comes from the
// files alone, checked here:
//  - with optimizer files, their metadata describes the groups as a FULL save writes it:
//    "<group>.params" (the group's fqns, comma-separated, in layout order), ".optimizer",
//    ".step", and, from exports that have them, ".version" and ".momentum_initialized"
//    (else the import's version, and whether it has stepped with momentum state). Every
//    model tensor is in exactly one group, and every group's tensors have the same
//    optimizer state ("<fqn>.<state>": exp_avg, exp_avg_sq, max_exp_avg_sq,
//    momentum_buffer, fp32, of the tensor's shape), and nothing else is in the files;
//  - without them, one group "imported" holds every model tensor at the import's
//    version, as a weights-only checkpoint (the optimizer starts afresh at a load).
// A SHARDED export's shard-<i>.safetensors, i < n, hold pieces of the tensors, and shard
// 0's metadata describes the groups (kShardedDescriptionKey) as a SHARDED save's manifest
// does; every field is checked, and the pieces must tile every tensor, and every optimizer
// state its group lists, exactly (nothing missing, twice or extra). Server 0 writes the
// index.json of a SHARDED save for them. Weights only, the groups keep their versions and
// lose their optimizer state (the files keep its pieces, which no load reads).
// A load then takes tensors by name as from any FULL or SHARDED checkpoint
// (server/checkpoint_loader.h). Functions of the files only; thread-safe.
#ifndef FLATSHARD_SERVER_CHECKPOINT_IMPORT_H_
#define FLATSHARD_SERVER_CHECKPOINT_IMPORT_H_

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint_kind.h"

namespace flatshard::server {

// OK for a file a FULL or SHARDED state dict holds (see above); InvalidArgument naming it
// otherwise.
[[nodiscard]] absl::Status CheckImportedFileName(const std::string& file);

// What an import's files hold, for its manifest.
struct ImportedCheckpoint {
  CheckpointKind kind = CheckpointKind::kFull;
  std::vector<std::string> groups;  // their names
  bool optimizer = false;
  int shards = 0;          // SHARDED: the shard files
  std::string index_json;  // SHARDED: the text of its index.json
};

// Describes the files `files` (name -> size) of directory `dir`, whose groups get
// `version` where the files do not say; `group_specs` gets the manifest's "groups" (as
// server/checkpoint_writer.cc's GroupJson writes them, without "align"). `weights_only`:
// the checkpoint holds no optimizer state (FULL: no optimizer file may come).
// InvalidArgument saying what is wrong: a file missing or not mapped by its index, a
// malformed header, a tensor in no group or in two, optimizer state missing or of
// another dtype or shape; SHARDED: a shard file missing, a group's field missing or
// malformed, a piece missing, twice or of nothing described.
[[nodiscard]] absl::StatusOr<ImportedCheckpoint> DescribeImport(const std::string& dir,
                                                                const std::map<std::string, uint64_t>& files,
                                                                int64_t version, bool weights_only,
                                                                nlohmann::json& group_specs);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_IMPORT_H_
