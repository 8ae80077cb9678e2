// What a CLI command connects with: the cluster, token, TLS files and job it was given.
// Internal to the CLI.
#ifndef FLATSHARD_CLIENT_CLI_COMMAND_CLIENT_H_
#define FLATSHARD_CLIENT_CLI_COMMAND_CLIENT_H_

#include <string>
#include <vector>

#include "flatshard/client.h"

namespace flatshard::cli {

// --tls_ca_file, --tls_cert_file, --tls_key_file: as ClientOptions' (TLS to the servers
// when ca_file is set; the certificate for servers that ask callers for one).
struct CommandTls {
  std::string ca_file = {};
  std::string cert_file = {};
  std::string key_file = {};

  void ApplyTo(ClientOptions& options) const {
    options.tls_ca_file = ca_file;
    options.tls_cert_file = cert_file;
    options.tls_key_file = key_file;
  }
};

inline ClientOptions CommandClientOptions(const std::vector<std::string>& servers, const std::string& token,
                                          const CommandTls& tls, const std::string& job) {
  ClientOptions options;
  options.servers = servers;
  options.token = token;
  tls.ApplyTo(options);
  options.job = job;
  return options;
}

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_COMMAND_CLIENT_H_
