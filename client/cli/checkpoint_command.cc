#include "client/cli/checkpoint_command.h"

#include <nlohmann/json.hpp>
#include <ostream>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/cli/human_bytes.h"
#include "flatshard/client.h"

namespace flatshard::cli {

int RunCheckpointCommand(const CheckpointCommandOptions& options, std::ostream& out, std::ostream& err) {
  const std::string& command = options.command;
  if (options.servers.empty()) {
    err << "flatshard " << command << ": --cluster is required\n";
    return 2;
  }
  if (command == "export" && options.out.empty()) {
    err << "flatshard export: --out=DIR is required\n";
    return 2;
  }
  if (command != "checkpoints" && command != "export" && options.name.empty()) {
    err << "flatshard " << command << ": --name is required\n";
    return 2;
  }
  CheckpointKind kind = CheckpointKind::kSharded;
  if (options.kind == "full") {
    kind = CheckpointKind::kFull;
  } else if (options.kind == "local") {
    kind = CheckpointKind::kLocal;
  } else if (options.kind != "sharded") {
    err << "flatshard " << command << ": --kind must be full, sharded or local\n";
    return 2;
  }
  ClientOptions client_options;
  client_options.servers = options.servers;
  client_options.token = options.token;
  client_options.job = options.job;
  client_options.timeout = absl::Minutes(10);
  auto client = Client::Connect(client_options);
  if (!client.ok()) {
    err << "flatshard " << command << ": " << client.status() << "\n";
    return 1;
  }
  const absl::Time start = absl::Now();
  absl::Status status;
  if (command == "save") {
    status = (*client)->SaveCheckpoint(options.name, kind, options.optimizer, options.async);
  } else if (command == "load") {
    status = (*client)->LoadCheckpoint(options.name);
  } else if (command == "export") {
    status = (*client)->ExportStateDict(options.out, kind, options.optimizer);
  } else if (command == "delete") {
    status = (*client)->DeleteCheckpoint(options.name);
  } else {
    auto list = (*client)->ListCheckpoints();
    status = list.status();
    if (status.ok() && options.json) {
      nlohmann::json entries = nlohmann::json::array();
      for (const CheckpointEntry& e : *list) {
        entries.push_back({{"name", e.name}, {"complete", e.complete}, {"kind", e.kind}, {"job", e.job},
                           {"servers", e.servers}, {"optimizer", e.optimizer}, {"bytes", e.bytes},
                           {"versions", e.versions}});
      }
      out << entries.dump(2) << "\n";
    } else if (status.ok()) {
      out << absl::StrFormat("%-24s %-10s %-8s %-10s %7s %9s %10s  %s\n", "name", "state", "kind", "job",
                             "servers", "optimizer", "size", "versions");
      for (const CheckpointEntry& e : *list) {
        std::string versions;
        for (const auto& [group, version] : e.versions) absl::StrAppend(&versions, group, "@", version, " ");
        out << absl::StrFormat("%-24s %-10s %-8s %-10s %7d %9s %10s  %s\n", e.name,
                               e.complete ? "complete" : "INCOMPLETE", e.kind, e.job, e.servers,
                               e.optimizer ? "yes" : "no", HumanBytes(e.bytes), versions);
      }
    }
  }
  if (!status.ok()) {
    err << "flatshard " << command << ": " << status << "\n";
    return 1;
  }
  if (command != "checkpoints") {
    out << absl::StrFormat("%s '%s': done in %.2f s\n", command, command == "export" ? options.out : options.name,
                           absl::ToDoubleSeconds(absl::Now() - start));
  }
  return 0;
}

}  // namespace flatshard::cli
