// RunCommand: runs a shell command line for tests that exercise the real binaries, and
// returns its exit code (-1 if it did not exit normally) and everything it wrote to
// stdout. Fold stderr in with "2>&1" in the command. Blocks until the command exits.
#ifndef FLATSHARD_TESTS_RUN_COMMAND_H_
#define FLATSHARD_TESTS_RUN_COMMAND_H_

#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <utility>

namespace flatshard::testing {

inline std::pair<int, std::string> RunCommand(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {-1, ""};
  std::string output;
  char buffer[4096];
  size_t read;
  while ((read = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, read);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_RUN_COMMAND_H_
