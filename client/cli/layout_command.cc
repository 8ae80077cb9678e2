#include "client/cli/layout_command.h"

#include <algorithm>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/human_bytes.h"
#include "core/dtype.h"
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

absl::StatusOr<OptimizerBuffers> BuffersFor(const LayoutCommandOptions& options) {
  const std::string& kind = options.optimizer;
  OptimizerBuffers buffers;
  if (kind == "adam" || kind == "adamw") {
    buffers = OptimizerBuffers{.kind = kind, .grads = 1, .state = 2};
  } else if (kind == "sgd" || kind == "average") {
    buffers = OptimizerBuffers{.kind = kind, .grads = 1, .state = 0};
  } else if (kind == "sgd-momentum") {
    buffers = OptimizerBuffers{.kind = kind, .grads = 1, .state = 1};
  } else if (kind == "frozen") {
    buffers = OptimizerBuffers{.kind = kind, .grads = 0, .state = 0};
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer_kind=", kind, ": expected adam, adamw, sgd, sgd-momentum, frozen or average"));
  }
  if (options.workers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--workers=", options.workers, ": expected 1 or more"));
  }
  if (options.replica_groups < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replica_groups=", options.replica_groups, ": expected 1 or more"));
  }
  buffers.replicas = options.replica_groups;
  if (options.memory != "host" && options.memory != "pinned" && options.memory != "device") {
    return absl::InvalidArgumentError(absl::StrCat("--memory=", options.memory, ": expected host, pinned or device"));
  }
  buffers.device_tier = options.memory == "device";
  const struct {
    const char* flag;
    const std::string& name;
    int64_t& bytes;
  } dtypes[] = {{"grad_dtype", options.grad_dtype, buffers.staging_bytes},
                {"gather_dtype", options.gather_dtype, buffers.snapshot_bytes}};
  for (const auto& d : dtypes) {
    const absl::StatusOr<DType> dtype = ParseDType(d.name);
    if (!dtype.ok() || !IsFloatingParamDType(*dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", d.flag, "=", d.name, ": expected float32, bfloat16 or float16"));
    }
    d.bytes = static_cast<int64_t>(DTypeSize(*dtype));
  }
  buffers.staging_bytes *= buffers.grads == 0 ? 0 : options.workers;  // frozen groups take no gradients
  return buffers;
}

int64_t ExchangeBytesPerServer(const FlatLayout& layout, const OptimizerBuffers& buffers, int replica) {
  if (buffers.replicas <= 1 || buffers.grads == 0) return 0;
  int64_t chunk_numel = 0;
  for (int q = 0; q < buffers.replicas; ++q) {
    if (replica < 0 || q == replica) {
      chunk_numel = std::max(chunk_numel, ReplicaChunk(layout.shard_numel(), buffers.replicas, q).second);
    }
  }
  const int64_t reduced = buffers.device_tier ? layout.shard_numel() : 0;
  return 4 * (layout.shard_numel() + (buffers.replicas - 1) * chunk_numel + reduced);
}

int64_t PlannedBytesPerServer(const FlatLayout& layout, const OptimizerBuffers& buffers, int replica) {
  return layout.shard_numel() *
             ((1 + buffers.grads + buffers.state) * 4 + buffers.staging_bytes + buffers.snapshot_bytes) +
         ExchangeBytesPerServer(layout, buffers, replica);
}

std::string FormatLayoutTable(const FlatLayout& layout, const OptimizerBuffers& buffers) {
  // The server keeps an fp32 master copy and, unless frozen, an fp32 gradient and the
  // optimizer's fp32 state (Adam: two moments) per shard element (padding included); a
  // staging slot per worker and the current version's gather snapshot beside them.
  const int64_t shard_numel = layout.shard_numel();
  const int64_t shard_bytes = shard_numel * 4;
  const int64_t staging = buffers.staging_bytes * shard_numel;
  const int64_t snapshot = buffers.snapshot_bytes * shard_numel;
  // A hybrid job's servers differ by their chunk's rounding: the column shows the largest.
  const bool hybrid = buffers.replicas > 1;
  const std::string exchange =
      hybrid ? absl::StrFormat(" %11s", HumanBytes(ExchangeBytesPerServer(layout, buffers, -1))) : "";
  std::string table = absl::StrFormat(
      "%d tensors, %d servers, align %d: unpadded %d elements, shard %d, padded %d\n",
      layout.num_tensors(), layout.num_shards(), layout.align(), layout.unpadded_numel(),
      layout.shard_numel(), layout.padded_numel());
  if (hybrid) {
    absl::StrAppendFormat(&table, "hybrid: %d replica groups of these %d servers (%d servers in all)\n",
                          buffers.replicas, layout.num_shards(), buffers.replicas * layout.num_shards());
  }
  absl::StrAppendFormat(&table, "%-6s %-27s %9s %11s %11s %11s %11s %11s%s  %s\n", "server", "range", "padding",
                        "params", "grads", buffers.kind, "staging", "snapshot",
                        hybrid ? absl::StrFormat(" %11s", "exchange") : "", "tensors");
  for (int rank = 0; rank < layout.num_shards(); ++rank) {
    absl::StrAppendFormat(&table, "%-6d %-27s %9d %11s %11s %11s %11s %11s%s  %s\n", rank,
                          absl::StrCat("[", layout.shard_start(rank), ", ", layout.shard_end(rank), ")"),
                          layout.shard_padding(rank), HumanBytes(shard_bytes), HumanBytes(buffers.grads * shard_bytes),
                          HumanBytes(buffers.state * shard_bytes), HumanBytes(staging), HumanBytes(snapshot), exchange,
                          ShardTensors(layout, rank));
  }
  absl::StrAppendFormat(&table, "per server: %s (params + grads + %s state + staging + snapshot%s)\n",
                        HumanBytes(PlannedBytesPerServer(layout, buffers)), buffers.kind,
                        hybrid ? " + exchange, at most" : "");
  return table;
}

int RunLayoutCommand(const LayoutCommandOptions& options, std::istream& in, std::ostream& out,
                     std::ostream& err) {
  const absl::StatusOr<OptimizerBuffers> buffers = BuffersFor(options);
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
