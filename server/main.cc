// flatshard-server: one shard server of a cluster. See README.md, "Running servers".
#include <signal.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <iostream>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "core/command_line.h"
#include "core/file.h"
#include "core/lock_order_checks.h"
#include "core/signal_route.h"
#include "proto/cluster_info.h"
#include "server/log.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "gRPC control-plane address HOST:PORT");
ABSL_FLAG(std::string, data_listen, "", "TCP data-plane address HOST:PORT (default: control port + 1)");
ABSL_FLAG(int, max_data_hellos, 1024,
          "data-plane connections that may wait for their hello (and TLS handshake) at once; a connection "
          "past that closes the one that has waited longest, so a flood of silent connections cannot use up "
          "the server's threads while clients, whose hello follows their connect, still get through");
ABSL_FLAG(absl::Duration, data_io_timeout, absl::Seconds(60),
          "how long a data-plane request may go without a byte moving either way (a worker or peer that "
          "stopped mid-transfer) before its connection is closed and the request dropped");
ABSL_FLAG(absl::Duration, data_idle_timeout, absl::Hours(24),
          "how long a data-plane connection may stay silent between requests before it is closed (clients "
          "open a new one when they next need it)");
ABSL_FLAG(int, rank, 0, "this server's rank: its index in --cluster");
ABSL_FLAG(std::string, cluster, "",
          "every server's control address in rank order, comma-separated; the same list on "
          "every server and client (default: --listen alone)");
ABSL_FLAG(std::string, memory, "host", "storage tier: host, pinned or device (GPU build)");
ABSL_FLAG(std::string, auth_token_file, "", "file holding the cluster's shared token (empty: no auth)");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate (chain) of this server: the gRPC control plane then speaks TLS; it "
          "must name the host of --listen (empty: plaintext)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Minutes(5),
          "how often --tls_cert_file, --tls_key_file, --tls_ca_file and --tls_client_ca_file are read again, "
          "so that a renewed certificate is served, and a new CA bundle checked against, without a restart; "
          "a key that is not the certificate's, or a file that does not parse, is ignored until it is (0: never); "
          "SIGHUP reads them at once");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle the other servers' certificates are checked against (empty: the "
          "system's roots)");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle that must have signed the certificate every caller (workers, commands, the other "
          "servers) presents: mutual TLS, on top of the token (empty: no client certificate is asked for)");
ABSL_FLAG(std::string, checkpoint_root, "", "directory that confines every checkpoint path");
ABSL_FLAG(uint64_t, max_file_size, 5'000'000'000,
          "FULL checkpoints: split into model-0000i-of-0000N.safetensors above this many bytes");
ABSL_FLAG(int, threads, 0, "gRPC server threads (0: gRPC's default)");
ABSL_FLAG(int, compute_threads, 0,
          "threads the host and pinned tiers' kernels (optimizer, reduction, casts) run on, "
          "shared by all groups (0: one per hardware thread)");
ABSL_FLAG(absl::Duration, nccl_timeout, absl::Seconds(60),
          "how long an NCCL channel may take to join, and a transfer to finish, before the "
          "channel is aborted (a dead worker)");
ABSL_FLAG(absl::Duration, peer_timeout, absl::Seconds(30),
          "how long this server keeps trying to reach a peer (clipping's norm shares, hybrid "
          "sharding's partials) and waits for a peer replica group to reach a step");
ABSL_FLAG(absl::Duration, staged_load_timeout, absl::Minutes(10),
          "how long a checkpoint load read into memory here waits for its commit before it is "
          "dropped with its memory (its client died between the two phases)");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(2),
          "on SIGTERM or SIGINT, how long the control-plane calls in progress (a save's last "
          "writes, say) get to finish before they are cancelled; requests waiting for other "
          "workers end at once, and open connections with no call do not wait for it");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT where Prometheus scrapes /metrics (port 0 picks one; empty: no metrics), over HTTPS "
          "with --tls_cert_file's certificate, plain HTTP without; scrapes present --metrics_token_file's "
          "token, or else --auth_token_file's, as basic auth's password");
ABSL_FLAG(std::string, metrics_token_file, "",
          "file holding the token scrapes of /metrics present, so that the scraper never holds the "
          "cluster token (empty: the cluster token, if any)");
ABSL_FLAG(bool, metrics_client_certificates, false,
          "with --tls_client_ca_file: scrapes of /metrics must also present a certificate those CAs signed "
          "for client use, as every control-plane caller does (the metrics token is still asked for)");
ABSL_FLAG(bool, tls_data_plane, false,
          "with --tls_cert_file: the data plane speaks TLS too (the same certificate, and client certificates "
          "asked for with --tls_client_ca_file): tensor bytes and session tokens no longer cross the network in "
          "the clear, at a cost in throughput (bench/RESULTS.md)");
ABSL_FLAG(std::string, log_level, "info",
          "debug (every RPC and data-plane error), info (jobs, groups, checkpoints, start and stop), "
          "warning (refused requests an operator should see) or error");
ABSL_FLAG(std::string, log_file, "", "append the log to this file (empty: stderr)");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "check every lock taken against a process-wide graph of lock order and abort on a cycle (a "
          "debugging aid, on in the tests' clusters: every lock then waits on one global lock)");

namespace {

int Fail(const std::string& message) {
  std::cerr << "flatshard-server: " << message << "\n";
  return 2;
}

// The token in `path` (--`flag`), surrounding whitespace stripped; why not when the file
// cannot be read or holds none.
absl::StatusOr<std::string> ReadToken(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> text = flatshard::ReadFileToString(path);
  if (!text.ok()) return absl::InvalidArgumentError(absl::StrCat("cannot read --", flag, "=", path));
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, " is empty"));
  return token;
}

}  // namespace

int main(int argc, char** argv) {
  // The main thread takes the stop signals and SIGHUP, whichever thread they reach, from
  // before any other thread starts. SIGHUP (systemctl reload) reads the TLS files again at
  // once, where it used to end the server as its default action does.
  flatshard::SignalRoute signals({SIGTERM, SIGINT, SIGHUP});
  absl::SetProgramUsageMessage("flatshard-server --listen=HOST:PORT --rank=I --cluster=A0,A1,...");
  const std::vector<std::string> positional =
      flatshard::ParseCommandLineOrExit(argc, argv, "flatshard-server");
  if (!positional.empty()) return Fail("unexpected argument '" + positional[0] + "'");
  flatshard::SetLockOrderChecks(absl::GetFlag(FLAGS_mutex_deadlock_detection));  // off unless asked

  flatshard::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.data_listen = absl::GetFlag(FLAGS_data_listen);
  options.rank = absl::GetFlag(FLAGS_rank);
  const std::string cluster = absl::GetFlag(FLAGS_cluster);
  options.cluster = cluster.empty() ? std::vector<std::string>{options.listen}
                                    : absl::StrSplit(cluster, ',', absl::SkipEmpty());
  options.memory = absl::GetFlag(FLAGS_memory);
  options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  if (!options.checkpoint_root.empty()) {
    std::error_code error;
    const auto root = std::filesystem::canonical(options.checkpoint_root, error);
    if (error || !std::filesystem::is_directory(root, error)) {
      return Fail("--checkpoint_root=" + options.checkpoint_root + " is not an existing directory");
    }
    options.checkpoint_root = root.string();
  }
  options.threads = absl::GetFlag(FLAGS_threads);
  options.data.max_hellos = absl::GetFlag(FLAGS_max_data_hellos);
  options.data.io_timeout = absl::GetFlag(FLAGS_data_io_timeout);
  options.data.idle_timeout = absl::GetFlag(FLAGS_data_idle_timeout);
  options.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options.nccl_timeout = absl::GetFlag(FLAGS_nccl_timeout);
  options.peer_timeout = absl::GetFlag(FLAGS_peer_timeout);
  options.staged_load_timeout = absl::GetFlag(FLAGS_staged_load_timeout);
  options.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.max_file_bytes = absl::GetFlag(FLAGS_max_file_size);
  if (options.max_file_bytes == 0) return Fail("--max_file_size must be > 0");
  for (auto [flag, path, token] :
       {std::tuple{"auth_token_file", absl::GetFlag(FLAGS_auth_token_file), &options.auth_token},
        std::tuple{"metrics_token_file", absl::GetFlag(FLAGS_metrics_token_file), &options.metrics_token}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> read = ReadToken(flag, path);
    if (!read.ok()) return Fail(std::string(read.status().message()));
    *token = *std::move(read);
  }
  const struct {
    const char* flag;
    std::string path;
    std::string* pem;
  } tls_files[] = {{"--tls_cert_file", absl::GetFlag(FLAGS_tls_cert_file), &options.tls.cert_chain},
                   {"--tls_key_file", absl::GetFlag(FLAGS_tls_key_file), &options.tls.private_key},
                   {"--tls_ca_file", absl::GetFlag(FLAGS_tls_ca_file), &options.tls.root_certs},
                   {"--tls_client_ca_file", absl::GetFlag(FLAGS_tls_client_ca_file), &options.tls.client_root_certs}};
  for (const auto& file : tls_files) {
    if (file.path.empty()) continue;
    absl::StatusOr<std::string> text = flatshard::ReadFileToString(file.path);
    if (!text.ok()) {
      return Fail(absl::StrCat("cannot read ", file.flag, "=", file.path, ": ", text.status().message()));
    }
    *file.pem = *std::move(text);
  }
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  options.tls.metrics_client_certificates = absl::GetFlag(FLAGS_metrics_client_certificates);
  options.tls.data_plane = absl::GetFlag(FLAGS_tls_data_plane);
  if (absl::Status valid = flatshard::server::ValidateServerOptions(options); !valid.ok()) {
    return Fail(std::string(valid.message()));
  }
  if (absl::Status logging = flatshard::server::ConfigureLogging(
          {.rank = options.rank, .level = absl::GetFlag(FLAGS_log_level), .file = absl::GetFlag(FLAGS_log_file)});
      !logging.ok()) {
    return Fail(std::string(logging.message()));
  }

  // Past a file size limit (`ulimit -f`, LimitFSIZE=) a checkpoint write fails with EFBIG,
  // which the save reports as RESOURCE_EXHAUSTED, instead of SIGXFSZ killing the server.
  signal(SIGXFSZ, SIG_IGN);

  flatshard::server::Server server(options);
  if (absl::Status started = server.Start(); !started.ok()) {
    spdlog::error("cannot start: {}", std::string(started.message()));
    return 1;
  }
  // LocalCluster (python/flatshard/local_cluster.py) waits for this line.
  spdlog::info("serving as rank {} of {}: control {} (gRPC), data port {} ({}), memory {}, {}, {}{}, flatshard {}",
               options.rank, options.cluster.size(), options.listen, server.data_port(),
               options.tls.data_plane ? "TLS" : "TCP", options.memory,
               options.auth_token.empty() ? "no auth" : "token auth",
               options.tls.requires_client_certificates() ? "mutual TLS"
               : options.tls.enabled()                    ? "TLS"
                                                          : "plaintext gRPC",
               options.metrics_listen.empty() ? ""
               : options.tls.metrics_client_certificates
                   ? ", metrics " + server.metrics_url() + " (client certificates)"
                   : ", metrics " + server.metrics_url(),
               std::string(flatshard::FlatshardVersion()));
  int signal_number = 0;
  while ((signal_number = signals.Wait()) == SIGHUP) spdlog::info("SIGHUP: {}", server.ReloadTls());
  spdlog::info("{}: shutting down", strsignal(signal_number));
  server.Shutdown();
  spdlog::info("stopped");
  return 0;
}
