// Server: one flatshard-server, assembled from its parts (registry of groups, gRPC
// control plane, TCP data plane). Start() binds both planes or fails with the reason;
// Shutdown() stops accepting, cancels in-flight requests and joins every thread.
// Start/Shutdown from one thread.
//
//   Server server(options);
//   FLATSHARD_RETURN_IF_ERROR(server.Start());
//   ... server.Shutdown();
#ifndef FLATSHARD_SERVER_SERVER_H_
#define FLATSHARD_SERVER_SERVER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/auth.h"
#include "server/checkpoint_store.h"
#include "server/clip_coordinator.h"
#include "server/data_server.h"
#include "server/ipc_plane.h"
#include "server/metrics.h"
#include "server/nccl_plane.h"
#include "server/peer_client.h"
#include "server/registry.h"
#include "server/service.h"
#include "server/stats.h"
#include "server/step_driver.h"
#include "server/tls.h"
#include "server/tls_files.h"

namespace grpc {
class Server;
}

namespace flatshard::server {

struct ServerOptions {
  std::string listen = "127.0.0.1:7070";  // gRPC control plane
  std::string data_listen;                // default: control port + 1
  int rank = 0;
  std::vector<std::string> cluster;       // every server's control address, rank order
  std::string memory = "host";
  std::string auth_token;                 // empty: no authentication
  std::string checkpoint_root;            // empty: checkpoints disabled
  uint64_t max_file_bytes = 5'000'000'000;  // FULL checkpoints split above this
  int threads = 0;                        // gRPC sync-server threads (0: gRPC's default)
  int compute_threads = 0;                // CPU tiers' kernel threads (0: one per hardware thread)
  absl::Duration nccl_timeout = absl::Seconds(60);  // an NCCL channel's join and transfers
  // Reaching a peer (norm shares, hybrid partials) and waiting for a peer replica group.
  absl::Duration peer_timeout = absl::Seconds(30);
  // A checkpoint load staged here and not committed (or aborted) within this is dropped.
  absl::Duration staged_load_timeout = absl::Minutes(10);
  // At a shutdown, how long the control-plane calls in progress get to finish before they
  // are cancelled (connections with no call in progress do not wait for it).
  absl::Duration shutdown_grace = absl::Seconds(2);
  std::string metrics_listen;             // HOST:PORT of /metrics (empty: no metrics)
  // What scrapes of /metrics present as basic auth's password (empty: auth_token).
  std::string metrics_token;
  TlsOptions tls;                         // gRPC over TLS when it holds a certificate
  DataServerOptions data;
};

// InvalidArgument naming the flag for: a rank outside the cluster, a duplicate address,
// --listen not equal to cluster[rank], an unknown memory tier, negative thread counts,
// --max_data_hellos below 1, a timeout that is not positive, a negative shutdown grace,
// TLS files that do not go together (server/tls.h), a metrics token or metrics client
// certificates without
// metrics, or metrics whose scrapes would carry the cluster token in clear next to a TLS
// control plane; FailedPrecondition for --memory=pinned|device in a build without CUDA or
// on a machine without a GPU.
[[nodiscard]] absl::Status ValidateServerOptions(const ServerOptions& options);

// The data-plane address clients and peer servers are told to connect to (OpenSession,
// GetStatus): the --data_listen host with the port bound, except that a --data_listen
// host of 0.0.0.0 (every interface) is replaced by the --listen host, the address this
// server is reached at: told 0.0.0.0, a client on another node would connect to itself.
std::string AdvertisedDataAddress(absl::string_view listen_host, absl::string_view data_host, int data_port);

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();

  [[nodiscard]] absl::Status Start();
  void Shutdown();
  // Reads the TLS files again now, as every --tls_reload_interval does (SIGHUP): what was
  // done, for the log (TlsFiles logs what it took and why it took nothing).
  std::string ReloadTls();
  int control_port() const { return control_port_; }
  // "checking", "agreed" or "mismatch: ..." (see ClusterInfo in the proto).
  std::string cluster_check() const;
  int data_port() const { return data_ ? data_->port() : 0; }
  // Where /metrics is served (HOST:PORT as bound); empty without --metrics_listen.
  std::string metrics_address() const { return metrics_ ? metrics_->address() : ""; }
  std::string metrics_url() const { return metrics_ ? metrics_->url() : ""; }  // http(s)://.../metrics

 private:
  // The tier of --memory (host when invalid: Start() refuses such options anyway).
  MemoryTier memory_tier() const {
    return ParseMemoryTier(options_.memory).value_or(MemoryTier::kHost);
  }

  ServerOptions options_;
  const std::shared_ptr<const ComputePool> compute_pool_;  // the groups' CPU kernel threads
  Registry registry_;
  // The certificate and key the control plane and metrics present, and the CA bundle
  // the peer calls check against, kept current from their files (with
  // --tls_reload_interval; null without): outlives their users. An error is Start()'s.
  absl::StatusOr<std::unique_ptr<TlsFiles>> tls_files_;
  PeerClient peers_;
  ClipCoordinator clip_;
  ServerStats stats_;  // its RPCs in flight are the gRPC server's: declared before it
  StepDriver driver_;
  CheckpointStore checkpoints_;
  SessionTokens sessions_;
  IpcPlane ipc_;
  NcclPlane nccl_;
  std::unique_ptr<DataServer> data_;
  std::unique_ptr<FlatshardService> service_;
  // The service once it is made: the metrics endpoint starts before it (the service
  // names the endpoint's address) and serves empty scrapes until then.
  std::atomic<FlatshardService*> serving_{nullptr};
  std::unique_ptr<MetricsEndpoint> metrics_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int control_port_ = 0;

  // Start-up agreement check with the peers, in the background until every peer has
  // answered once (or Shutdown).
  void CheckCluster();
  std::thread cluster_check_thread_;
  // Says the warnings, and gRPC's own lines (LogHeldBackGrpcLines), held back with none of
  // their kind since (LogThrottle), every period and at Shutdown.
  void LogHeldBack(absl::Time now);
  std::thread held_back_thread_;
  absl::Notification stopping_;
  mutable absl::Mutex check_mu_;
  std::string cluster_check_ ABSL_GUARDED_BY(check_mu_) = "checking";
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SERVER_H_
