// `flatshard delete-job`: deletes a job on every server (Client::DeleteJob) once its
// training is over, freeing its groups' memory. Stateless.
//
//   int exit_code = RunDeleteJobCommand({.servers = {...}, .job = "mlp"}, std::cout, std::cerr);
#ifndef FLATSHARD_CLIENT_CLI_JOB_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_JOB_COMMAND_H_

#include <iosfwd>
#include <string>
#include <vector>

#include "client/cli/command_client.h"

namespace flatshard::cli {

struct DeleteJobCommandOptions {
  std::vector<std::string> servers{};
  std::string token{};
  std::string job{};          // required: no default, so that no job is deleted by accident
  CommandTls tls{};
};

// Returns 0 when the job was deleted, 1 when the cluster refused or no server had the
// job (the status on `err`), 2 on bad options.
int RunDeleteJobCommand(const DeleteJobCommandOptions& options, std::ostream& out, std::ostream& err);

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_JOB_COMMAND_H_
