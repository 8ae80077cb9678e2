// index.json of a SHARDED checkpoint: where every stored piece of every tensor lives, so
// that a loading server reads this one file and then only the pieces it needs:
//
//   {"pieces": {
//    "<group>/<fqn>[.<state>]": [[first element, numel, "<file>", byte offset], ...],
//    ...}}
//
// (first element: of the piece within the tensor; byte offset: of its float32 data in
// the file). The committing server writes it as text from the shard files' safetensors
// headers (read in parallel), whose tensors are named
// "<group>/<fqn>@<first element>[.<state>]" (WriteShards); every loading server reads it
// with a SAX reader, without a JSON tree (12 MB for 20000 groups). Free functions, no
// state.
#ifndef FLATSHARD_SERVER_SHARDED_INDEX_H_
#define FLATSHARD_SERVER_SHARDED_INDEX_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::server {

// One stored piece of a tensor (or of one of its optimizer states).
struct StoredPiece {
  std::string file;
  int64_t intra_start = 0;  // first element within the tensor
  int64_t numel = 0;
  uint64_t offset = 0;  // byte offset of its float32 data in `file`
};

// Stored pieces by "<group>/<fqn>[.<state>]", each list in the order the index gives.
using ShardedIndex = std::map<std::string, std::vector<StoredPiece>>;

// The text of index.json for the shard files `files` of directory `dir` (their headers
// are read and validated): DataLoss naming the file for a damaged header or a tensor not
// named as WriteShards names them.
[[nodiscard]] absl::StatusOr<std::string> ShardedIndexJson(const std::string& dir,
                                                           const std::vector<std::string>& files);

// Parses index.json (`text`, read from `path`): DataLoss naming `path` if it is not the
// JSON above (counts below 2^63, no key listed twice); other top-level keys are skipped.
[[nodiscard]] absl::StatusOr<ShardedIndex> ParseShardedIndex(const std::string& text, const std::string& path);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SHARDED_INDEX_H_
