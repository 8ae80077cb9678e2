// `flatshard save | load | checkpoints | delete | export | import`: checkpoint operations through the C++
// client, with one line of progress per phase. Stateless.
#ifndef FLATSHARD_CLIENT_CLI_CHECKPOINT_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_CHECKPOINT_COMMAND_H_

#include <iosfwd>
#include <string>
#include <vector>

#include "client/cli/command_client.h"

namespace flatshard::cli {

struct CheckpointCommandOptions {
  std::string command;  // save, load, checkpoints, delete, export, import
  std::vector<std::string> servers;
  std::string token;
  CommandTls tls;
  std::string job = "default";
  std::string name;
  std::string kind = "sharded";
  bool optimizer = false;
  bool async = false;  // save: return after the snapshot
  bool non_strict = false;  // load: Client::LoadCheckpointNonStrict, printing what it left out
  // save, export: where the job's trained groups are cut (CutAt): "now" (the versions as
  // they are), "boundary" (the end of the step in progress) or a version.
  std::string cut = "now";
  bool json = false;
  std::string out;  // export: the local directory to write into
  int chunk_mib = 4;  // export, import: MiB per streamed chunk
  std::string in;     // import: the local directory to read
  bool weights_only = false;  // import: without the optimizer files
  int64_t at_version = 0;     // import: Client::ImportCheckpoint's version
};

// Returns 0 on success, 1 when the cluster refused (the status on `err`), 2 on bad options,
// 130 when a save, load, export or import was cancelled by Ctrl-C or SIGTERM (cli/cancel_on_signal.h).
int RunCheckpointCommand(const CheckpointCommandOptions& options, std::ostream& out, std::ostream& err);

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_CHECKPOINT_COMMAND_H_
