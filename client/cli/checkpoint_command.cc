#include "client/cli/checkpoint_command.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli/cancel_on_signal.h"
#include "client/cli/command_client.h"
#include "client/cli/human_bytes.h"
#include "flatshard/client.h"

namespace flatshard::cli {
namespace {

// Draws "[######    ]  45%  1.2 GiB / 2.6 GiB  850.0 MB/s  ETA 2 s" in place on a terminal
// (at most 10 times a second), or a plain line per 10% otherwise ("save: ...").
Client::Progress ProgressPrinter(std::ostream& out, const std::string& command) {
  struct State {
    absl::Time start = absl::Now();
    absl::Time last_draw = absl::InfinitePast();
    int last_decile = -1;
  };
  auto state = std::make_shared<State>();
  const bool terminal = isatty(STDOUT_FILENO);
  return [&out, state, terminal, command](uint64_t done, uint64_t total) {
    const absl::Time now = absl::Now();
    const double fraction = total == 0 ? 0.0 : static_cast<double>(done) / static_cast<double>(total);
    const double seconds = std::max(1e-3, absl::ToDoubleSeconds(now - state->start));
    const double rate = static_cast<double>(done) / seconds;
    const double eta = rate > 0 ? static_cast<double>(total - std::min(done, total)) / rate : 0.0;
    const std::string line = absl::StrFormat("%3.0f%%  %s / %s  %.1f MB/s  ETA %.0f s", 100 * fraction,
                                             HumanBytes(static_cast<int64_t>(done)),
                                             HumanBytes(static_cast<int64_t>(total)), rate / 1e6, eta);
    if (terminal) {
      if (now - state->last_draw < absl::Milliseconds(100) && done < total) return;
      state->last_draw = now;
      const int filled = static_cast<int>(30 * fraction);
      out << "\r[" << std::string(filled, '#') << std::string(30 - filled, ' ') << "] " << line << std::flush;
      return;
    }
    const int decile = static_cast<int>(10 * fraction);
    if (decile != state->last_decile) {
      state->last_decile = decile;
      out << command << ": " << line << "\n";
    }
  };
}

// "big@3 tiny@3": the version of each group of a checkpoint.
std::string VersionsText(const std::map<std::string, int64_t>& versions) {
  std::string text;
  for (const auto& [group, version] : versions) absl::StrAppend(&text, text.empty() ? "" : " ", group, "@", version);
  return text;
}

// The versions that checkpoint `name` holds, as VersionsText, once it is complete; empty
// otherwise (an async save still being written) or where the list cannot be had.
std::string SavedVersions(Client& client, const std::string& name) {
  const absl::StatusOr<std::vector<CheckpointEntry>> list = client.ListCheckpoints();
  if (!list.ok()) return "";
  for (const CheckpointEntry& e : *list) {
    if (e.name == name && e.complete) return VersionsText(e.versions);
  }
  return "";
}

// --cut: "now", "boundary" or a version; InvalidArgument otherwise.
absl::StatusOr<CutAt> ParseCut(const std::string& cut) {
  if (cut == "now") return CutAt();
  if (cut == "boundary") return CutAt::StepBoundary();
  int64_t version = 0;
  if (absl::SimpleAtoi(cut, &version) && version >= 0) return CutAt::Version(version);
  return absl::InvalidArgumentError("--cut must be now, boundary or a version (an integer >= 0)");
}

}  // namespace

int RunCheckpointCommand(const CheckpointCommandOptions& options, std::ostream& out, std::ostream& err) {
  const std::string& command = options.command;
  if (options.servers.empty()) {
    err << "flatshard " << command << ": --cluster is required\n";
    return 2;
  }
  if (options.non_strict && command != "load") {
    err << "flatshard " << command << ": --non_strict applies to load only\n";
    return 2;
  }
  if (command == "export" && options.out.empty()) {
    err << "flatshard export: --out=DIR is required\n";
    return 2;
  }
  if (command == "import" && options.in.empty()) {
    err << "flatshard import: --in=DIR is required\n";
    return 2;
  }
  if (command == "import" && options.at_version < 0) {
    err << "flatshard import: --at_version must be >= 0\n";
    return 2;
  }
  if (command != "checkpoints" && command != "export" && options.name.empty()) {
    err << "flatshard " << command << ": --name is required\n";
    return 2;
  }
  const absl::StatusOr<CheckpointKind> kind = ParseCheckpointKind(options.kind);
  if (!kind.ok()) {
    err << "flatshard " << command << ": --kind must be full, sharded or local\n";
    return 2;
  }
  const absl::StatusOr<CutAt> cut = ParseCut(options.cut);
  if (!cut.ok()) {
    err << "flatshard " << command << ": " << cut.status().message() << "\n";
    return 2;
  }
  ClientOptions client_options = CommandClientOptions(options.servers, options.token, options.tls, options.job);
  // How long the cut may wait for training to reach it (a version minutes ahead); the
  // save, load or export itself has no deadline (ClientOptions::model_timeout).
  client_options.timeout = absl::Minutes(10);
  if (options.chunk_mib < 1 || options.chunk_mib > 64) {
    err << "flatshard " << command << ": --chunk_mib must be in [1, 64]\n";
    return 2;
  }
  client_options.export_chunk_bytes = static_cast<uint32_t>(options.chunk_mib) << 20;
  const bool moves_the_model = command == "save" || command == "load" || command == "export" || command == "import";
  std::optional<CancelOnSignal> interrupts;  // before the client's threads start
  if (moves_the_model) interrupts.emplace(err, command);
  auto client = Client::Connect(client_options);
  if (!client.ok()) {
    err << "flatshard " << command << ": " << client.status() << "\n";
    return 1;
  }
  if (interrupts) interrupts->Watch([&c = **client] { c.CancelCheckpointCalls(); });
  const absl::Time start = absl::Now();
  absl::Status status;
  bool signalled = false;
  IncompatibleTensors omitted;  // a non-strict load's
  ImportedCheckpoint imported;
  if (moves_the_model) {
    // The progress bar ends its line once something was drawn.
    auto drawn = std::make_shared<bool>(false);
    Client::Progress progress = [printer = ProgressPrinter(out, command), drawn](uint64_t done, uint64_t total) {
      *drawn = true;
      printer(done, total);
    };
    if (command == "save") {
      status = (*client)->SaveCheckpoint(options.name, *kind, options.optimizer, options.async, progress, *cut);
    } else if (command == "load" && options.non_strict) {
      absl::StatusOr<IncompatibleTensors> loaded = (*client)->LoadCheckpointNonStrict(options.name, progress);
      status = loaded.status();
      if (loaded.ok()) omitted = *std::move(loaded);
    } else if (command == "load") {
      status = (*client)->LoadCheckpoint(options.name, progress);
    } else if (command == "import") {
      absl::StatusOr<ImportedCheckpoint> done =
          (*client)->ImportCheckpoint(options.name, options.in, !options.weights_only, options.at_version, progress);
      status = done.status();
      if (done.ok()) imported = *std::move(done);
    } else {
      status = (*client)->ExportStateDict(options.out, *kind, options.optimizer, progress, *cut);
    }
    if (*drawn && isatty(STDOUT_FILENO)) out << "\n";
    signalled = interrupts->signalled();
    interrupts.reset();  // its repeated cancel uses the client, which goes first otherwise
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
        out << absl::StrFormat("%-24s %-10s %-8s %-10s %7d %9s %10s  %s\n", e.name,
                               e.complete ? "complete" : "INCOMPLETE", e.kind, e.job, e.servers,
                               e.optimizer ? "yes" : "no", HumanBytes(e.bytes), VersionsText(e.versions));
      }
    }
  }
  if (!status.ok()) {
    err << "flatshard " << command << ": " << status << "\n";
    return signalled ? 130 : 1;
  }
  if (command != "checkpoints") {
    // The versions a save holds (a blocking one's: an async one is still being written).
    const std::string saved =
        command == "save" || command == "import" ? SavedVersions(**client, options.name) : "";
    out << absl::StrFormat("%s '%s': done in %.2f s%s\n", command, command == "export" ? options.out : options.name,
                           absl::ToDoubleSeconds(absl::Now() - start), saved.empty() ? "" : ", groups at " + saved);
  }
  if (command == "import") {
    out << absl::StrFormat("%s %s in %d group(s), %s optimizer state; load it with: flatshard load --name=%s\n",
                           absl::AsciiStrToUpper(CheckpointKindName(imported.kind)),
                           HumanBytes(static_cast<int64_t>(imported.bytes)), imported.groups.size(),
                           imported.optimizer ? "with" : "without", options.name);
  }
  if (options.non_strict && command == "load") {
    out << "missing (not in the checkpoint, kept as they were): "
        << (omitted.missing.empty() ? "none" : absl::StrJoin(omitted.missing, " ")) << "\n";
    out << "unexpected (no group registers them, not loaded): "
        << (omitted.unexpected.empty() ? "none" : absl::StrJoin(omitted.unexpected, " ")) << "\n";
  }
  return 0;
}

}  // namespace flatshard::cli
