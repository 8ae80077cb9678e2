// `flatshard`: the admin command line. Subcommands:
//   flatshard layout [SPEC.json|-] [--json]   print a group's flat layout per server
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "client/cli/layout_command.h"

ABSL_FLAG(bool, json, false, "layout: print the full layout as JSON instead of a table");

namespace {

constexpr char kUsage[] =
    "flatshard <command> [args]\n"
    "\n"
    "commands:\n"
    "  layout [SPEC.json|-] [--json]  read a layout spec (file or stdin) and print the\n"
    "                                 layout per server: shard ranges, memory, tensors\n";

int Layout(const std::vector<char*>& args) {
  const flatshard::cli::LayoutCommandOptions options{.json = absl::GetFlag(FLAGS_json)};
  if (args.size() > 3) {
    std::cerr << "flatshard layout: expected at most one spec file\n";
    return 2;
  }
  if (args.size() < 3 || std::string(args[2]) == "-") {
    return flatshard::cli::RunLayoutCommand(options, std::cin, std::cout, std::cerr);
  }
  std::ifstream file(args[2]);
  if (!file) {
    std::cerr << "flatshard layout: cannot open '" << args[2] << "'\n";
    return 2;
  }
  return flatshard::cli::RunLayoutCommand(options, file, std::cout, std::cerr);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string command = args[1];
  if (command == "layout") return Layout(args);
  std::cerr << "flatshard: unknown command '" << command << "'\n\n" << kUsage;
  return 2;
}
