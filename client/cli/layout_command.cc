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

absl::StatusOr<OptimizerBuffers> BuffersFor(absl::string_view optimizer) {
  const std::string kind(optimizer);
  if (kind == "adam" || kind == "adamw") return OptimizerBuffers{.kind = kind, .grads = 1, .state = 2};
  if (kind == "sgd") return OptimizerBuffers{.kind = kind, .grads = 1, .state = 0};
  if (kind == "sgd-momentum") return OptimizerBuffers{.kind = kind, .grads = 1, .state = 1};
  if (kind == "frozen") return OptimizerBuffers{.kind = kind, .grads = 0, .state = 0};
  return absl::InvalidArgumentError(absl::StrCat("--optimizer_kind=", optimizer,
                                                 ": expected adam, adamw, sgd, sgd-momentum or frozen"));
}

std::string FormatLayoutTable(const FlatLayout& layout, const OptimizerBuffers& buffers) {
  // The server keeps an fp32 master copy and, unless frozen, an fp32 gradient and the
  // optimizer's fp32 state (Adam: two moments) per shard element (padding included).
  const int64_t shard_bytes = layout.shard_numel() * 4;
  std::string table = absl::StrFormat(
      "%d tensors, %d servers, align %d: unpadded %d elements, shard %d, padded %d\n",
      layout.num_tensors(), layout.num_shards(), layout.align(), layout.unpadded_numel(),
      layout.shard_numel(), layout.padded_numel());
  absl::StrAppendFormat(&table, "%-6s %-27s %9s %11s %11s %11s  %s\n", "server", "range",
                        "padding", "params", "grads", buffers.kind, "tensors");
  for (int rank = 0; rank < layout.num_shards(); ++rank) {
    absl::StrAppendFormat(&table, "%-6d %-27s %9d %11s %11s %11s  %s\n", rank,
                          absl::StrCat("[", layout.shard_start(rank), ", ",
                                       layout.shard_end(rank), ")"),
                          layout.shard_padding(rank), HumanBytes(shard_bytes),
                          HumanBytes(buffers.grads * shard_bytes), HumanBytes(buffers.state * shard_bytes),
                          ShardTensors(layout, rank));
  }
  absl::StrAppendFormat(&table, "per server: %s (params + grads + %s state)\n",
                        HumanBytes((1 + buffers.grads + buffers.state) * shard_bytes), buffers.kind);
  return table;
}

int RunLayoutCommand(const LayoutCommandOptions& options, std::istream& in, std::ostream& out,
                     std::ostream& err) {
  const absl::StatusOr<OptimizerBuffers> buffers = BuffersFor(options.optimizer);
  if (!buffers.ok()) {
    err << "flatshard layout: " << buffers.status().message() << "\n";
    return 2;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  absl::StatusOr<FlatLayout> layout = ParseLayoutSpecJson(text);
  if (!layout.ok()) {
    err << "flatshard layout: " << layout.status().message() << "\n";
    return 2;
  }
  out << (options.json ? LayoutToJson(*layout) : FormatLayoutTable(*layout, *buffers));
  return 0;
}

}  // namespace flatshard::cli
