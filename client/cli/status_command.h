// `flatshard status`: every server's groups, versions, memory and traffic, as a table
// or as JSON (--json) for scripts. The jobs' table sums up each job's groups (how many,
// their versions, their memory on all servers); the table of groups, one row per group
// per server, is printed when it has at most max_group_rows rows or `all_groups` asks
// for it, and the latency table then has a row per group, else one per job. The servers
// sum up each job's groups themselves (GetStatusRequest.summarize_groups); the groups are
// fetched only to be listed or where a job's load digests differ between servers (to name
// the groups holding different loads), so a status of tens of thousands of groups asks
// for none of them. Stateless.
#ifndef FLATSHARD_CLIENT_CLI_STATUS_COMMAND_H_
#define FLATSHARD_CLIENT_CLI_STATUS_COMMAND_H_

#include <iosfwd>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/cli/command_client.h"

namespace flatshard::cli {

struct StatusCommandOptions {
  std::vector<std::string> servers = {};
  std::string token = {};
  CommandTls tls = {};
  bool json = false;
  bool all_groups = false;    // --groups
  int max_group_rows = 100;  // more are summed up per job (a model of many small groups)
  absl::Duration timeout = absl::Seconds(5);
};

// Returns 0 when every server answered, 1 otherwise (unreachable servers are listed).
int RunStatusCommand(const StatusCommandOptions& options, std::ostream& out, std::ostream& err);

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_STATUS_COMMAND_H_
