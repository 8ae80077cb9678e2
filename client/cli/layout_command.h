// `flatshard layout`: reads a layout spec (JSON) and prints the layout, as a table for
// operators planning memory per server or as JSON (core/layout_json.h) for scripts.
// Stateless; safe to call from any thread with distinct streams.
//
//   std::ifstream spec("model.json");
//   int exit_code = RunLayoutCommand({.json = true}, spec, std::cout, std::cerr);
#ifndef FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_

#include <cstdint>
#include <iosfwd>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layout.h"

namespace flatshard::cli {

struct LayoutCommandOptions {
  bool json = false;  // print the full layout as JSON instead of the table
  // The optimizer whose state the memory columns count: adam (adamw alike), sgd,
  // sgd-momentum, frozen (parameters only) or average (module buffers: no state).
  std::string optimizer = "adam";
  // The workers that scatter to each server (a hybrid-sharded job's: those of one
  // replica group) and the dtypes of their gradients and gathers: each worker has a
  // staging slot per server, and each gathered dtype a snapshot.
  int workers = 1;
  std::string grad_dtype = "float32";
  std::string gather_dtype = "float32";
  // A hybrid-sharded job's replica groups (R; the spec's `servers` are then those of one
  // replica group): each server also keeps the exchange buffers.
  int replica_groups = 1;
  // The servers' --memory (host, pinned or device): the device tier's hybrid servers keep
  // the reduced gradient apart from the parameters' tier.
  std::string memory = "host";
};

// What a server keeps per shard element besides the fp32 parameters: fp32 buffers for
// one optimizer kind (default: Adam), and the bytes of the workers' staging slots and of
// the gather snapshot.
struct OptimizerBuffers {
  std::string kind = "adam";  // as LayoutCommandOptions::optimizer names it
  int grads = 1;
  int state = 2;
  int64_t staging_bytes = 4;   // all workers' gradients (0 for frozen groups)
  int64_t snapshot_bytes = 4;  // one element in the gather dtype
  int replicas = 1;            // replica groups exchanging the gradient (1: none)
  bool device_tier = false;    // --memory=device
};
// The buffers of the kind `optimizer` names for `options`' workers and dtypes;
// InvalidArgument naming the flag that is wrong.
[[nodiscard]] absl::StatusOr<OptimizerBuffers> BuffersFor(const LayoutCommandOptions& options);

// Returns the process exit code: 0 on success, 2 when the spec is malformed or invalid or
// the optimizer unknown (one line "flatshard layout: <reason>" on `err`).
int RunLayoutCommand(const LayoutCommandOptions& options, std::istream& in, std::ostream& out,
                     std::ostream& err);

// A hybrid-sharded job's exchange buffers on a server of replica group `replica`: its own
// fp32 partial of the whole shard, and the partials of its chunk (core/layout.h
// ReplicaChunk) that the other replica groups send, and on the device tier the reduced
// gradient (a shard's fp32, in host-addressable memory the exchange writes to). 0 without
// replicas or gradients. `replica` -1: the most any replica group's server keeps (chunks
// differ by their rounding).
int64_t ExchangeBytesPerServer(const FlatLayout& layout, const OptimizerBuffers& buffers, int replica);

// The memory a server of replica group `replica` (-1: the most of any; all are alike
// without replicas) holds for one group of `layout`, as FormatLayoutTable's last line
// says. A second gather snapshot exists while a slow reader still holds the previous
// version's.
int64_t PlannedBytesPerServer(const FlatLayout& layout, const OptimizerBuffers& buffers, int replica = -1);

// The per-server table: shard range, padding, fp32 parameter / gradient /
// optimizer-state bytes, staging and snapshot bytes (and a hybrid job's largest exchange
// buffers), and the tensor pieces each server holds.
std::string FormatLayoutTable(const FlatLayout& layout, const OptimizerBuffers& buffers = {});

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_
