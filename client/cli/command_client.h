// The client a CLI command connects with: the cluster, token, TLS and job it was given.
// Internal to the CLI.
#ifndef FLATSHARD_CLIENT_CLI_COMMAND_CLIENT_H_
#define FLATSHARD_CLIENT_CLI_COMMAND_CLIENT_H_

#include <string>
#include <vector>

#include "flatshard/client.h"

namespace flatshard::cli {

inline ClientOptions CommandClientOptions(const std::vector<std::string>& servers, const std::string& token,
                                          const std::string& tls_ca_file, const std::string& job) {
  ClientOptions options;
  options.servers = servers;
  options.token = token;
  options.tls_ca_file = tls_ca_file;
  options.job = job;
  return options;
}

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_COMMAND_CLIENT_H_
