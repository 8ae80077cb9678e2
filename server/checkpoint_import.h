// Checkpoint imports (ImportCheckpoint, proto/flatshard.proto): a FULL state dict brought
// from a client's disk into server 0's root, as the files of a checkpoint whose manifest
// server 0 writes. The files are what an export writes, or what PyTorch and Hugging Face
// tools write (names as core/state_dict_files.h gives them): model.safetensors, or
// model.safetensors.index.json and the split files its weight_map names; optionally the
// optimizer's likewise. What the manifest says of them comes from the files alone, checked here:
//  - with optimizer files, their metadata describes the groups as a FULL save writes it:
//    "<group>.params" (the group's fqns, comma-separated, in layout order), ".optimizer",
//    ".step", and, from exports that have them, ".version" and ".momentum_initialized"
//    (else the import's version, and whether it has stepped with momentum state). Every
//    model tensor is in exactly one group, and every group's tensors have the same
//    optimizer state ("<fqn>.<state>": exp_avg, exp_avg_sq, max_exp_avg_sq,
//    momentum_buffer, fp32, of the tensor's shape), and nothing else is in the files;
//  - without them, one group "imported" holds every model tensor at the import's
//    version, as a weights-only checkpoint (the optimizer starts afresh at a load).
// A load then takes tensors by name as from any FULL checkpoint (server/checkpoint_loader.h).
// Functions of the files only; thread-safe.
#ifndef FLATSHARD_SERVER_CHECKPOINT_IMPORT_H_
#define FLATSHARD_SERVER_CHECKPOINT_IMPORT_H_

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace flatshard::server {

// OK for a file a FULL state dict holds (see above); InvalidArgument naming it otherwise.
[[nodiscard]] absl::Status CheckImportedFileName(const std::string& file);

// What an import's files hold, for its manifest.
struct ImportedCheckpoint {
  std::vector<std::string> groups;  // their names
  bool optimizer = false;
};

// Describes the files `files` (name -> size) of directory `dir`, whose groups get
// `version` where the files do not say; `group_specs` gets the manifest's "groups" (as
// server/checkpoint_writer.cc's GroupJson writes them, without "align").
// InvalidArgument saying what is wrong: a file missing or not mapped by its index, a
// malformed header, a tensor in no group or in two, optimizer state missing or of
// another dtype or shape.
[[nodiscard]] absl::StatusOr<ImportedCheckpoint> DescribeImport(const std::string& dir,
                                                                const std::map<std::string, uint64_t>& files,
                                                                int64_t version, nlohmann::json& group_specs);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_IMPORT_H_
