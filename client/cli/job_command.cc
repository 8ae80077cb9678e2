#include "client/cli/job_command.h"

#include <ostream>

#include "client/cli/command_client.h"
#include "client/cli/human_bytes.h"
#include "flatshard/client.h"

namespace flatshard::cli {

int RunDeleteJobCommand(const DeleteJobCommandOptions& options, std::ostream& out, std::ostream& err) {
  if (options.servers.empty()) {
    err << "flatshard delete-job: --cluster is required\n";
    return 2;
  }
  if (options.job.empty()) {
    err << "flatshard delete-job: --job is required (the job to delete)\n";
    return 2;
  }
  auto client = Client::Connect(CommandClientOptions(options.servers, options.token, options.tls, options.job));
  if (!client.ok()) {
    err << "flatshard delete-job: " << client.status() << "\n";
    return 1;
  }
  const absl::StatusOr<int64_t> freed = (*client)->DeleteJob();
  if (!freed.ok()) {
    err << "flatshard delete-job: " << freed.status() << "\n";
    return 1;
  }
  out << "deleted job '" << options.job << "': " << HumanBytes(*freed) << " of groups freed on "
      << options.servers.size() << " servers\n";
  return 0;
}

}  // namespace flatshard::cli
