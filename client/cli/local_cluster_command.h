// `flatshard local-cluster`: starts N flatshard-server processes on 127.0.0.1 for
// development, prints the --cluster list, and waits; SIGINT/SIGTERM stops them all
// (SIGTERM, then waits for each). If any server exits on its own, the others are
// stopped too and the command fails. Call from the main thread only.
#ifndef FLATSHARD_CLIENT_CLI_LOCAL_CLUSTER_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_LOCAL_CLUSTER_COMMAND_H_

#include <string>

namespace flatshard::cli {

struct LocalClusterOptions {
  int servers = 2;
  int base_port = 7070;             // server i: control base+2i, data base+2i+1
  std::string server_binary;        // path of flatshard-server
  std::string auth_token_file;      // passed through
  std::string checkpoint_root;      // passed through
};

// Returns the exit code: 0 after a clean stop, 1 if a server failed, 2 on bad options.
int RunLocalClusterCommand(const LocalClusterOptions& options);

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_LOCAL_CLUSTER_COMMAND_H_
