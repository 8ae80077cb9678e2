// `flatshard layout`: reads a layout spec (JSON) and prints the layout, as a table for
// operators planning memory per server or as JSON (core/layout_json.h) for scripts.
// Stateless; safe to call from any thread with distinct streams.
//
//   std::ifstream spec("model.json");
//   int exit_code = RunLayoutCommand({.json = true}, spec, std::cout, std::cerr);
#ifndef FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_

#include <iosfwd>

#include "core/layout.h"

namespace flatshard::cli {

struct LayoutCommandOptions {
  bool json = false;  // print the full layout as JSON instead of the table
};

// Returns the process exit code: 0 on success, 2 when the spec is malformed or invalid
// (one line "flatshard layout: <reason>" on `err`).
int RunLayoutCommand(const LayoutCommandOptions& options, std::istream& in, std::ostream& out,
                     std::ostream& err);

// The per-server table: shard range, padding, fp32 parameter / gradient / Adam-state
// bytes, and the tensor pieces each server holds.
std::string FormatLayoutTable(const FlatLayout& layout);

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_LAYOUT_COMMAND_H_
