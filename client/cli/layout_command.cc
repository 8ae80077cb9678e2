#include "client/cli/layout_command.h"

#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/human_bytes.h"
#include "core/layout_json.h"

namespace flatshard::cli {
namespace {

// "fc.weight[0:12]" for each tensor piece a shard holds.
std::string ShardTensors(const FlatLayout& layout, int rank) {
  std::vector<std::string> pieces;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ShardParamInfo info = layout.shard_param_info(rank, i);
    if (!info.in_shard) continue;
    pieces.push_back(absl::StrCat(layout.tensor(i).fqn, "[", info.intra_param_start_idx, ":",
                                  info.intra_param_end_idx + 1, "]"));
  }
  return pieces.empty() ? "(padding only)" : absl::StrJoin(pieces, " ");
}

}  // namespace

std::string FormatLayoutTable(const FlatLayout& layout) {
  // The server keeps an fp32 master copy, an fp32 gradient accumulator and, for Adam,
  // two fp32 moments per shard element (padding included).
  const int64_t shard_bytes = layout.shard_numel() * 4;
  std::string table = absl::StrFormat(
      "%d tensors, %d servers, align %d: unpadded %d elements, shard %d, padded %d\n",
      layout.num_tensors(), layout.num_shards(), layout.align(), layout.unpadded_numel(),
      layout.shard_numel(), layout.padded_numel());
  absl::StrAppendFormat(&table, "%-6s %-27s %9s %11s %11s %11s  %s\n", "server", "range",
                        "padding", "params", "grads", "adam", "tensors");
  for (int rank = 0; rank < layout.num_shards(); ++rank) {
    absl::StrAppendFormat(&table, "%-6d %-27s %9d %11s %11s %11s  %s\n", rank,
                          absl::StrCat("[", layout.shard_start(rank), ", ",
                                       layout.shard_end(rank), ")"),
                          layout.shard_padding(rank), HumanBytes(shard_bytes),
                          HumanBytes(shard_bytes), HumanBytes(2 * shard_bytes),
                          ShardTensors(layout, rank));
  }
  absl::StrAppendFormat(&table, "per server: %s (params + grads + Adam state)\n",
                        HumanBytes(4 * shard_bytes));
  return table;
}

int RunLayoutCommand(const LayoutCommandOptions& options, std::istream& in, std::ostream& out,
                     std::ostream& err) {
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  absl::StatusOr<FlatLayout> layout = ParseLayoutSpecJson(text);
  if (!layout.ok()) {
    err << "flatshard layout: " << layout.status().message() << "\n";
    return 2;
  }
  out << (options.json ? LayoutToJson(*layout) : FormatLayoutTable(*layout));
  return 0;
}

}  // namespace flatshard::cli
