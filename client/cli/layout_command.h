// `flatshard layout`: reads a layout spec (JSON) and prints the layout, as a table for
// operators planning memory per server or as JSON (core/layout_json.h) for scripts.
// Stateless; safe to call from any thread with distinct streams.
//
//   std::ifstream spec("model.json");
//   int exit_code = RunLayoutCommand({.json = true}, spec, std::cout, std::cerr);
#ifndef FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_

#include <iosfwd>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layout.h"

namespace flatshard::cli {

struct LayoutCommandOptions {
  bool json = false;  // print the full layout as JSON instead of the table
  // The optimizer whose state the memory columns count: adam (adamw alike), sgd,
  // sgd-momentum or frozen (parameters only).
  std::string optimizer = "adam";
};

// The fp32 buffers per shard element a server keeps besides the parameters for one
// optimizer kind (default: Adam).
struct OptimizerBuffers {
  std::string kind = "adam";  // as LayoutCommandOptions::optimizer names it
  int grads = 1;
  int state = 2;
};
// The buffers of the kind `optimizer` names; InvalidArgument listing the accepted names.
[[nodiscard]] absl::StatusOr<OptimizerBuffers> BuffersFor(absl::string_view optimizer);

// Returns the process exit code: 0 on success, 2 when the spec is malformed or invalid or
// the optimizer unknown (one line "flatshard layout: <reason>" on `err`).
int RunLayoutCommand(const LayoutCommandOptions& options, std::istream& in, std::ostream& out,
                     std::ostream& err);

// The per-server table: shard range, padding, fp32 parameter / gradient /
// optimizer-state bytes, and the tensor pieces each server holds.
std::string FormatLayoutTable(const FlatLayout& layout, const OptimizerBuffers& buffers = {});

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_
