// The JSON form of a layout spec and of a computed layout: the public contract of
// `flatshard layout` (README.md, "flatshard layout").
//
// Spec:   {"servers": N, "align": A, "tensors": [{"name", "shape", "dtype"}, ...]}
// Layout: {"unpadded_numel", "shard_numel", "padded_numel", "tensors": [...],
//          "shards": [{"rank", "start", "end", "padding", "params": [...]}, ...]}
// Pure functions; thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(FlatLayout layout, ParseLayoutSpecJson(text));
//   std::cout << LayoutToJson(layout);
#ifndef FLATSHARD_CORE_LAYOUT_JSON_H_
#define FLATSHARD_CORE_LAYOUT_JSON_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "core/layout.h"

namespace flatshard {

// Parses a spec and builds its layout. "align" is optional (default 0), "dtype" is
// optional (default float32). Returns InvalidArgument for malformed JSON (with the
// parser's position) or a missing / mistyped field (naming it), and every error of
// FlatLayout::Create.
[[nodiscard]] absl::StatusOr<FlatLayout> ParseLayoutSpecJson(absl::string_view text);

// The layout as pretty-printed JSON (2-space indent, trailing newline).
std::string LayoutToJson(const FlatLayout& layout);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_LAYOUT_JSON_H_
