// How a FULL state dict names its files, as Hugging Face tools and flatshard's FULL
// checkpoints and exports write them: "<prefix>.safetensors", or the split files
// "<prefix>-<i>-of-<n>.safetensors" (i and n of 5 or more digits) with
// "<prefix>.safetensors.index.json", whose "weight_map" says which file holds each
// tensor; prefix "model" for the parameters, "optimizer" for flatshard's optimizer state.
// And how a SHARDED state dict (an export's) names its files: "shard-<index>.safetensors",
// one per shard, whose tensors are pieces of the original tensors,
// "<group>/<fqn>@<first element>[.<state>]" (fp32, one dimension), and whose shard 0 says
// in its metadata what they are pieces of (kShardedDescriptionKey).
// Functions only; thread-safe.
#ifndef FLATSHARD_CORE_STATE_DICT_FILES_H_
#define FLATSHARD_CORE_STATE_DICT_FILES_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

// Whether `name` is one of `prefix`'s split files.
bool IsSplitStateDictFileName(absl::string_view name, absl::string_view prefix);

// Whether `name` is any file of a FULL state dict (model or optimizer).
bool IsStateDictFileName(absl::string_view name);

// Whether `name` is a SHARDED state dict's file, "shard-<index>.safetensors" (index in
// decimal, as ShardFileName writes it); sets `*index` if given.
bool IsShardFileName(absl::string_view name, int* index = nullptr);

// The name of a SHARDED state dict's file of shard `index`.
std::string ShardFileName(int index);

// Shard 0's metadata key whose value describes a SHARDED state dict (JSON): {"shards": the
// number of shard files, "optimizer": whether they hold optimizer state, "groups": as a
// checkpoint manifest lists them, [{"name", "tensors": [{"name", "shape", "dtype"}],
// "version", "optimizer", "optimizer_steps", "momentum_initialized", "state": [the state
// names each tensor has pieces of]}]}.
inline constexpr char kShardedDescriptionKey[] = "flatshard.sharded";

// The "weight_map" (tensor -> file) of an index's text; InvalidArgument naming `where`
// for text that is not JSON with a "weight_map" object of file names.
[[nodiscard]] absl::StatusOr<std::map<std::string, std::string>> ParseWeightMap(absl::string_view text,
                                                                                const std::string& where);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_STATE_DICT_FILES_H_
