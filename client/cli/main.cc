// `flatshard`: the admin command line (kUsage below lists every command): a group's flat layout
// per server, a cluster's status, a local cluster, checkpoints (save, load, list, delete, export)
// and a job's deletion.
#include <unistd.h>

#include <climits>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/checkpoint_command.h"
#include "client/cli/job_command.h"
#include "client/cli/layout_command.h"
#include "client/cli/local_cluster_command.h"
#include "client/cli/status_command.h"
#include "core/command_line.h"

ABSL_FLAG(bool, json, false, "layout, status, checkpoints: print JSON instead of a table");
ABSL_FLAG(std::string, optimizer_kind, "adam",
          "layout: the optimizer whose state the memory columns count (adam, adamw, sgd, sgd-momentum, "
          "frozen or average)");
ABSL_FLAG(int, workers, 1,
          "layout: workers scattering to each server (a hybrid-sharded job's: one replica group's); each has "
          "a staging slot there");
ABSL_FLAG(std::string, grad_dtype, "float32", "layout: the dtype the workers' gradients come in (their staging)");
ABSL_FLAG(std::string, gather_dtype, "float32", "layout: the dtype gathers ask for (the snapshot)");
ABSL_FLAG(int, replica_groups, 1,
          "layout: a hybrid-sharded job's replica groups (the spec's servers are one replica group's); "
          "each server also keeps the gradient exchange's buffers");
ABSL_FLAG(std::string, memory, "host",
          "layout: the servers' --memory (host, pinned or device; a hybrid job's device servers keep one more "
          "fp32 shard)");
ABSL_FLAG(bool, groups, false,
          "status: list every group on every server, however many (past 100 rows the jobs' table sums them up)");
ABSL_FLAG(std::string, cluster, "",
          "every command that calls servers: every server's control address, comma-separated");
ABSL_FLAG(std::string, auth_token_file, "", "file holding the cluster's token (empty: none)");
ABSL_FLAG(std::string, tls_ca_file, "",
          "commands that call servers: PEM CA bundle of servers started with --tls_cert_file (empty: "
          "plaintext gRPC)");
ABSL_FLAG(std::string, tls_cert_file, "",
          "commands that call servers: PEM certificate presented to servers started with --tls_client_ca_file "
          "(with --tls_key_file and --tls_ca_file)");
ABSL_FLAG(std::string, tls_key_file, "", "commands that call servers: PEM private key of --tls_cert_file");
ABSL_FLAG(int, servers, 2, "local-cluster: number of servers");
ABSL_FLAG(int, base_port, 7070, "local-cluster: server i listens on base_port+2i (data +1)");
ABSL_FLAG(std::string, checkpoint_root, "", "local-cluster: passed to every server");
ABSL_FLAG(std::string, job, "",
          "save, load, export: the job whose groups are checkpointed (empty: 'default'); delete-job: the job to "
          "delete (required)");
ABSL_FLAG(std::string, name, "", "save, load, delete, import: the checkpoint's name");
ABSL_FLAG(std::string, kind, "sharded", "save: full, sharded or local; export: full or sharded");
ABSL_FLAG(bool, optimizer, false, "save, export: include the optimizer state");
ABSL_FLAG(std::string, out, "", "export: local directory for the state dict's files");
ABSL_FLAG(int, chunk_mib, 4,
          "export, import: MiB per streamed chunk (1-64); bounds the memory per server stream");
ABSL_FLAG(std::string, in, "",
          "import: local directory holding a FULL state dict (model.safetensors, ...) or a SHARDED export "
          "(shard-<i>.safetensors)");
ABSL_FLAG(bool, weights_only, false, "import: leave the optimizer state out (the optimizer starts afresh at a load)");
ABSL_FLAG(int64_t, at_version, 0,
          "import: the version of the checkpoint's groups where the files do not say (a weights-only file)");
ABSL_FLAG(bool, async, false, "save: return once the servers have snapshotted; they write in the background");
ABSL_FLAG(bool, non_strict, false,
          "load: load what the checkpoint and the job's groups have in common (fine-tuning from another model's "
          "checkpoint, as torch's strict=False); the tensors it lacks keep their values, those no group registers "
          "are skipped, and both are printed");
ABSL_FLAG(std::string, cut, "now",
          "save, export: where the job's trained groups are cut: now (their versions as they are), boundary (the "
          "end of the step in progress, for groups that step together) or a version (waits for it)");

namespace {

constexpr char kUsage[] =
    "flatshard <command> [args]\n"
    "\n"
    "commands:\n"
    "  layout [SPEC.json|-] [--json] [--optimizer_kind=adam] [--workers=1]\n"
    "       [--grad_dtype=float32] [--gather_dtype=float32] [--replica_groups=1]\n"
    "       [--memory=host]\n"
    "                                  read a layout spec (file or stdin) and print the\n"
    "                                  layout per server: shard ranges, memory, tensors\n"
    "  status --cluster=A0,A1,... [--json] [--groups]\n"
    "                                  servers, groups, versions, memory and traffic\n"
    "  local-cluster --servers=N [--base_port=P] [--checkpoint_root=DIR]\n"
    "                                  start N servers on 127.0.0.1 and wait; Ctrl-C stops them\n"
    "  save --cluster=... --name=N --kind=full|sharded|local [--optimizer] [--async] [--job=J]\n"
    "       [--cut=now|boundary|VERSION]\n"
    "  load --cluster=... --name=N [--job=J] [--non_strict]\n"
    "  checkpoints --cluster=... [--json]   list checkpoints (complete or not)\n"
    "  delete --cluster=... --name=N\n"
    "  delete-job --cluster=... --job=J     delete a job whose training is over, with its groups\n"
    "  export --cluster=... --out=DIR --kind=full|sharded [--optimizer] [--chunk_mib=4] [--job=J]\n"
    "       [--cut=now|boundary|VERSION]\n"
    "                                  stream a state dict to this machine's disk\n"
    "  import --cluster=... --name=N --in=DIR [--weights_only] [--at_version=0] [--chunk_mib=4]\n"
    "                                  a FULL state dict or a SHARDED export on this\n"
    "                                  machine's disk becomes checkpoint N of its kind\n"
    "                                  (then: load --name=N)\n"
    "  (save, load, export, import: Ctrl-C cancels; the servers keep nothing of it; exit status 130)\n";

int Layout(const std::vector<std::string>& args) {
  const flatshard::cli::LayoutCommandOptions options{.json = absl::GetFlag(FLAGS_json),
                                                     .optimizer = absl::GetFlag(FLAGS_optimizer_kind),
                                                     .workers = absl::GetFlag(FLAGS_workers),
                                                     .grad_dtype = absl::GetFlag(FLAGS_grad_dtype),
                                                     .gather_dtype = absl::GetFlag(FLAGS_gather_dtype),
                                                     .replica_groups = absl::GetFlag(FLAGS_replica_groups),
                                                     .memory = absl::GetFlag(FLAGS_memory)};
  if (args.size() > 2) {
    std::cerr << "flatshard layout: expected at most one spec file\n";
    return 2;
  }
  if (args.size() < 2 || args[1] == "-") {
    return flatshard::cli::RunLayoutCommand(options, std::cin, std::cout, std::cerr);
  }
  std::ifstream file(args[1]);
  if (!file) {
    std::cerr << "flatshard layout: cannot open '" << args[1] << "'\n";
    return 2;
  }
  return flatshard::cli::RunLayoutCommand(options, file, std::cout, std::cerr);
}

bool ReadToken(std::string& token) {
  const std::string path = absl::GetFlag(FLAGS_auth_token_file);
  if (path.empty()) return true;
  std::ifstream file(path);
  if (!file) {
    std::cerr << "flatshard: cannot read --auth_token_file=" << path << "\n";
    return false;
  }
  std::stringstream text;
  text << file.rdbuf();
  token = std::string(absl::StripAsciiWhitespace(text.str()));
  return true;
}

// The --tls_* flags of the commands that call servers.
flatshard::cli::CommandTls CommandTls() {
  return {.ca_file = absl::GetFlag(FLAGS_tls_ca_file),
          .cert_file = absl::GetFlag(FLAGS_tls_cert_file),
          .key_file = absl::GetFlag(FLAGS_tls_key_file)};
}

int Status() {
  flatshard::cli::StatusCommandOptions options;
  options.servers = absl::StrSplit(absl::GetFlag(FLAGS_cluster), ',', absl::SkipEmpty());
  options.json = absl::GetFlag(FLAGS_json);
  options.all_groups = absl::GetFlag(FLAGS_groups);
  if (options.servers.empty()) {
    std::cerr << "flatshard status: --cluster is required\n";
    return 2;
  }
  if (!ReadToken(options.token)) return 2;
  options.tls = CommandTls();
  return flatshard::cli::RunStatusCommand(options, std::cout, std::cerr);
}

// flatshard-server next to this binary.
std::string SiblingBinary(const char* name) {
  char self[PATH_MAX] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string dir = len > 0 ? std::string(self, len) : std::string(".");
  dir = dir.substr(0, dir.rfind('/'));
  return dir + "/" + name;
}

int Checkpoint(const std::string& command) {
  flatshard::cli::CheckpointCommandOptions options;
  options.command = command;
  options.servers = absl::StrSplit(absl::GetFlag(FLAGS_cluster), ',', absl::SkipEmpty());
  options.job = absl::GetFlag(FLAGS_job).empty() ? "default" : absl::GetFlag(FLAGS_job);
  options.name = absl::GetFlag(FLAGS_name);
  options.kind = absl::GetFlag(FLAGS_kind);
  options.optimizer = absl::GetFlag(FLAGS_optimizer);
  options.json = absl::GetFlag(FLAGS_json);
  options.out = absl::GetFlag(FLAGS_out);
  options.async = absl::GetFlag(FLAGS_async);
  options.non_strict = absl::GetFlag(FLAGS_non_strict);
  options.cut = absl::GetFlag(FLAGS_cut);
  options.chunk_mib = absl::GetFlag(FLAGS_chunk_mib);
  options.in = absl::GetFlag(FLAGS_in);
  options.weights_only = absl::GetFlag(FLAGS_weights_only);
  options.at_version = absl::GetFlag(FLAGS_at_version);
  if (!ReadToken(options.token)) return 2;
  options.tls = CommandTls();
  return flatshard::cli::RunCheckpointCommand(options, std::cout, std::cerr);
}

int DeleteJob() {
  flatshard::cli::DeleteJobCommandOptions options;
  options.servers = absl::StrSplit(absl::GetFlag(FLAGS_cluster), ',', absl::SkipEmpty());
  options.job = absl::GetFlag(FLAGS_job);  // no default here: see the flag
  if (!ReadToken(options.token)) return 2;
  options.tls = CommandTls();
  return flatshard::cli::RunDeleteJobCommand(options, std::cout, std::cerr);
}

int LocalCluster() {
  flatshard::cli::LocalClusterOptions options;
  options.servers = absl::GetFlag(FLAGS_servers);
  options.base_port = absl::GetFlag(FLAGS_base_port);
  options.server_binary = SiblingBinary("flatshard-server");
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  return flatshard::cli::RunLocalClusterCommand(options);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<std::string> args = flatshard::ParseCommandLineOrExit(argc, argv, "flatshard");
  if (args.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  if (args[0] == "layout") return Layout(args);
  if (args[0] == "status") return Status();
  if (args[0] == "local-cluster") return LocalCluster();
  if (args[0] == "delete-job") return DeleteJob();
  if (args[0] == "save" || args[0] == "load" || args[0] == "checkpoints" || args[0] == "delete" ||
      args[0] == "export" || args[0] == "import") {
    return Checkpoint(args[0]);
  }
  std::cerr << "flatshard: unknown command '" << args[0] << "'\n\n" << kUsage;
  return 2;
}
