// Checkpoint loading: what one server needs of a committed checkpoint, read through a
// CheckpointReader (every extent verified as it is read) into host buffers that each
// group installs with Group::Restore. The manifest is checked against the registered
// groups first (kind, server count for LOCAL, shapes, dtypes, optimizer state, every
// tensor loaded once): a mismatch is FailedPrecondition naming it, damage is DataLoss
// naming the file, and nothing is installed here; the caller commits once every server
// has staged. FULL and SHARDED checkpoints load by tensor: a registered tensor comes
// from the checkpoint group of its group's name, else from the one group that holds its
// name, so a model wrapped into other groups (another auto-wrap size, param groups added
// or dropped) loads, each group from groups saved at one version; LOCAL holds flat
// shards and loads into the same groups and layouts only. FULL reads
// each tensor's pieces from the file holding it (split checkpoints: through the index),
// SHARDED the stored pieces overlapping this server's new shard (index.json), LOCAL this
// server's own file. Thread-compatible.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto files, ManifestFiles(manifest, dir));
//   CheckpointReader reader(dir, std::move(files), pool);
//   FLATSHARD_ASSIGN_OR_RETURN(StagedCheckpoint staged,
//                              StageCheckpoint(manifest, reader, registry, name, job, rank, servers, false, nullptr));
#ifndef FLATSHARD_SERVER_CHECKPOINT_LOADER_H_
#define FLATSHARD_SERVER_CHECKPOINT_LOADER_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "server/checkpoint_progress.h"
#include "server/checkpoint_reader.h"
#include "server/group.h"
#include "server/registry.h"

namespace flatshard::server {

// One group's shard as a load installs it (Group::Restore).
struct StagedGroup {
  std::shared_ptr<Group> group;
  LoadedShard shard;
  KeptState kept;  // a non-strict load's: what keeps its current values
};
using StagedGroups = std::vector<StagedGroup>;

// What a non-strict load leaves out, the same on every server of the job: the registered
// tensors the checkpoint lacks (they keep their values), in the registry's order, and the
// checkpoint's tensors no group registers (not loaded), in the manifest's.
struct LoadOmissions {
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
};

// What a load stages on this server.
struct StagedCheckpoint {
  StagedGroups groups;
  LoadOmissions omitted;
};

// The manifest's files: sizes and extents, checked to tile each file. DataLoss naming
// `where` (the checkpoint's directory, for messages) if the list is malformed.
[[nodiscard]] absl::StatusOr<std::map<std::string, ManifestFile>> ManifestFiles(const nlohmann::json& manifest,
                                                                               const std::string& where);

// This server's (`rank` of `num_servers`) shard of every group of `job` from checkpoint
// `name`, whose manifest is `manifest` and whose files `reader` reads. `progress`
// (optional) counts the tensor bytes read. A `non_strict` load (torch's
// load_state_dict(strict=False)) keeps the registered tensors the checkpoint lacks as
// they are, with their optimizer state (a trained group it holds nothing of is staged
// whole as kept, with the loaded trained groups' version when they agree; a frozen one
// is not staged), and skips the checkpoint's tensors no group registers; a tensor it
// holds with another shape or dtype is refused all the same.
[[nodiscard]] absl::StatusOr<StagedCheckpoint> StageCheckpoint(const nlohmann::json& manifest,
                                                               CheckpointReader& reader, const Registry& registry,
                                                               const std::string& name, const std::string& job,
                                                               int rank, int num_servers, bool non_strict,
                                                               ProgressCounter* progress);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_LOADER_H_
