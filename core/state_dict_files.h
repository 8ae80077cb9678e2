// How a FULL state dict names its files, as Hugging Face tools and flatshard's FULL
// checkpoints and exports write them: "<prefix>.safetensors", or the split files
// "<prefix>-<i>-of-<n>.safetensors" (i and n of 5 or more digits) with
// "<prefix>.safetensors.index.json", whose "weight_map" says which file holds each
// tensor; prefix "model" for the parameters, "optimizer" for flatshard's optimizer state.
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

// The "weight_map" (tensor -> file) of an index's text; InvalidArgument naming `where`
// for text that is not JSON with a "weight_map" object of file names.
[[nodiscard]] absl::StatusOr<std::map<std::string, std::string>> ParseWeightMap(absl::string_view text,
                                                                                const std::string& where);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_STATE_DICT_FILES_H_
