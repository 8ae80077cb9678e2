// Command-line parsing for flatshard's binaries on top of Abseil flags, with the exit
// codes our tools promise: a bad flag or value prints one line and exits 2 (absl's own
// parser exits 1). --help / --helpfull / -h print the usage message
// (absl::SetProgramUsageMessage, which main sets first) and every flag the program
// defines, by file, and exit 0. Call once from main.
//
//   std::vector<std::string> args = ParseCommandLineOrExit(argc, argv, "flatshard-server");
#ifndef FLATSHARD_CORE_COMMAND_LINE_H_
#define FLATSHARD_CORE_COMMAND_LINE_H_

#include <string>
#include <vector>

namespace flatshard {

// Sets every --name=value / --name value / --bool / --nobool flag and returns the
// positional arguments (argv[0] excluded).
std::vector<std::string> ParseCommandLineOrExit(int argc, char** argv, const char* program);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_COMMAND_LINE_H_
