// Checkpoint writing: one server's shard of every group of a job at one version
// (SavedShard) and the files a save or an export writes from it into a CheckpointSink,
// in the formats server/checkpoint_store.h describes. FULL: this server's byte ranges of
// the shared safetensors files (server 0 adds the headers and split indexes); SHARDED
// and LOCAL: a file of its own. Each file is written in the order of its bytes, so that
// a server's consecutive pieces join into runs (one extent, one direct write). Data goes
// out in slices of at most 4 MiB, converted to the file's dtype on the way, which bounds
// the memory of a save or export whatever the model size. Functions are
// thread-compatible: one writer per sink.
//
//   FLATSHARD_ASSIGN_OR_RETURN(std::vector<SavedShard> shards,
//                              TakeShards(registry, rank, job, versions, deadline, /*pin=*/true));
//   FLATSHARD_ASSIGN_OR_RETURN(std::vector<std::string> files,
//                              WriteShards(sink, rank, CheckpointKind::kFull, true, max_file_bytes, shards, nullptr));
#ifndef FLATSHARD_SERVER_CHECKPOINT_WRITER_H_
#define FLATSHARD_SERVER_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/checkpoint_kind.h"
#include "server/checkpoint_progress.h"
#include "server/checkpoint_sink.h"
#include "server/group.h"
#include "server/registry.h"

namespace flatshard::server {

// Unpins a group when a save or export is done with it. Not copyable: exactly one Unpin
// per Pin.
class PinGuard {
 public:
  explicit PinGuard(std::shared_ptr<Group> group) : group_(std::move(group)) {}
  PinGuard(const PinGuard&) = delete;
  PinGuard& operator=(const PinGuard&) = delete;
  ~PinGuard() { group_->Unpin(); }

 private:
  std::shared_ptr<Group> group_;
};

// One server's shard of one group at one version: a snapshot (async saves: the copy lets
// training go on while the bytes are written) or the live group pinned at that version
// (blocking saves and exports: nothing is copied; the group's next optimizer step waits).
struct SavedShard {
  std::shared_ptr<Group> group;
  ShardSnapshot snapshot;  // values empty when pinned (metadata and state names only)
  int64_t start = 0;       // shard_start(rank)
  std::vector<TensorPiece> pieces;
  std::unique_ptr<PinGuard> pin;

  // `count` elements of the parameters (`state` empty) or of optimizer state `state`,
  // from element `offset` of the shard.
  [[nodiscard]] absl::Status Read(absl::string_view state, int64_t offset, int64_t count, float* out) const;
};

// This server's shard of every group of `job` at `versions`: snapshots, or with `pin`
// the live groups held at those versions (released when the SavedShards are destroyed;
// while it waits for one group to reach its version, the groups cut at the highest
// version stay there once they reach it: Group::HoldAt). FailedPrecondition for a job
// without groups, InvalidArgument for a group without a version, DeadlineExceeded if a
// version is not reached by `deadline`, Aborted (naming the group) if one has moved
// past its version (training overtook the cut).
[[nodiscard]] absl::StatusOr<std::vector<SavedShard>> TakeShards(const Registry& registry, int rank,
                                                                 const std::string& job,
                                                                 const std::map<std::string, int64_t>& versions,
                                                                 absl::Time deadline, bool pin);

// The tensor bytes WriteShards writes for `shards` (headers, a few KiB, aside): the
// progress total of a save.
uint64_t PartBytes(CheckpointKind kind, bool optimizer, const std::vector<SavedShard>& shards);

// Writes this server's part of the checkpoint files into `sink` (FULL files above
// `max_file_bytes` of data are split Hugging Face style); returns the names of the files
// it wrote to and, if asked, the groups' specs for the manifest (a JSON array). Not asked
// (an export: no manifest goes with the files), a SHARDED shard 0 carries them in its
// metadata (core/state_dict_files.h, kShardedDescriptionKey). With `progress`, adds each
// slice of tensor bytes to progress->done once the sink took it.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> WriteShards(CheckpointSink& sink, int rank,
                                                                   CheckpointKind kind, bool optimizer,
                                                                   uint64_t max_file_bytes,
                                                                   const std::vector<SavedShard>& shards,
                                                                   nlohmann::json* group_specs,
                                                                   ProgressCounter* progress = nullptr);

// A layout's tensors as the manifest lists them: [{"name", "shape", "dtype"}, ...].
nlohmann::json TensorsJson(const FlatLayout& layout);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_WRITER_H_
