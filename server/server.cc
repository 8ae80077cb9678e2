#include "server/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "proto/flatshard.grpc.pb.h"
#include "proto/keepalive.h"
#include "server/log.h"
#include "server/request_log.h"
#include "tls/certificates.h"
#include "transport/data_protocol.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::server {

absl::Status ValidateServerOptions(const ServerOptions& options) {
  std::string host;
  int port = 0;
  FLATSHARD_RETURN_IF_ERROR(transport::SplitHostPort(options.listen, host, port));
  if (options.cluster.empty()) return absl::InvalidArgumentError("--cluster: empty");
  if (options.rank < 0 || options.rank >= static_cast<int>(options.cluster.size())) {
    return absl::InvalidArgumentError(absl::StrCat("--rank=", options.rank, " is outside the ",
                                                   options.cluster.size(), " servers of --cluster"));
  }
  std::set<std::string> seen;
  for (const std::string& address : options.cluster) {
    FLATSHARD_RETURN_IF_ERROR(transport::SplitHostPort(address, host, port));
    if (!seen.insert(address).second) {
      return absl::InvalidArgumentError(absl::StrCat("--cluster lists ", address, " twice"));
    }
  }
  if (options.cluster[options.rank] != options.listen) {
    return absl::InvalidArgumentError(absl::StrCat("--listen=", options.listen, " but --cluster[",
                                                   options.rank, "] is ",
                                                   options.cluster[options.rank]));
  }
  FLATSHARD_RETURN_IF_ERROR(ParseMemoryTier(options.memory).status());
  FLATSHARD_RETURN_IF_ERROR(ValidateTls(options.tls));
  if (options.tls.reload_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_reload_interval=",
                                                   absl::FormatDuration(options.tls.reload_interval),
                                                   ": an interval is >= 0 (0: never)"));
  }
  if (options.data.max_hellos < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_data_hellos=", options.data.max_hellos, ": at least one connection must get to say hello"));
  }
  if (options.threads < 0 || options.compute_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--threads=", options.threads, ", --compute_threads=",
                                                   options.compute_threads, ": thread counts are >= 0"));
  }
  if (options.peer_timeout <= absl::ZeroDuration() || options.nccl_timeout <= absl::ZeroDuration() ||
      options.staged_load_timeout <= absl::ZeroDuration() || options.data.io_timeout <= absl::ZeroDuration() ||
      options.data.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--peer_timeout=", absl::FormatDuration(options.peer_timeout),
        ", --nccl_timeout=", absl::FormatDuration(options.nccl_timeout),
        ", --staged_load_timeout=", absl::FormatDuration(options.staged_load_timeout),
        ", --data_io_timeout=", absl::FormatDuration(options.data.io_timeout),
        ", --data_idle_timeout=", absl::FormatDuration(options.data.idle_timeout), ": timeouts are > 0"));
  }
  if (options.shutdown_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shutdown_grace=", absl::FormatDuration(options.shutdown_grace), ": a grace is >= 0"));
  }
  if (!options.data_listen.empty()) {
    FLATSHARD_RETURN_IF_ERROR(transport::SplitHostPort(options.data_listen, host, port));
  }
  if (!options.metrics_listen.empty()) {
    if (absl::Status split = transport::SplitHostPort(options.metrics_listen, host, port); !split.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_listen=", options.metrics_listen, ": ", split.message()));
    }
  } else if (!options.metrics_token.empty() || options.tls.metrics_client_certificates) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.metrics_token.empty() ? "--metrics_client_certificates" : "--metrics_token_file",
        " without --metrics_listen: no metrics to protect"));
  }
  std::error_code unreadable;  // a symlink loop, say: not a directory either
  if (!options.checkpoint_root.empty() && !std::filesystem::is_directory(options.checkpoint_root, unreadable)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint_root=", options.checkpoint_root, " is not a directory"));
  }
  return absl::OkStatus();
}

std::string AdvertisedDataAddress(absl::string_view listen_host, absl::string_view data_host, int data_port) {
  return absl::StrCat(data_host == "0.0.0.0" ? listen_host : data_host, ":", data_port);
}

Server::Server(ServerOptions options)
    : options_(std::move(options)),
      compute_pool_(std::make_shared<ComputePool>(options_.compute_threads)),
      registry_(options_.rank, static_cast<int>(options_.cluster.size()), memory_tier(), compute_pool_),
      tls_files_(options_.tls.reloads() ? TlsFiles::Start(options_.tls) : nullptr),
      peers_(options_.cluster, options_.rank, options_.auth_token,
             PeerCredentials(options_.tls, tls_files_.ok() ? tls_files_->get() : nullptr),
             options_.peer_timeout),
      clip_(registry_, options_.rank, static_cast<int>(options_.cluster.size()),
            [this](int peer, const std::string& job, int64_t step, double partial, uint64_t epoch) {
              return peers_.SendNormPartial(peer, job, step, partial, epoch);
            }),
      driver_(
          static_cast<int>(options_.cluster.size()), clip_,
          [this](int peer) -> absl::StatusOr<std::unique_ptr<transport::Connection>> {
            FLATSHARD_ASSIGN_OR_RETURN(const PeerClient::Session session, peers_.OpenSession(peer));
            // A live peer answers the hello at once; a peer that stopped since
            // OpenSession is given up on after peer_timeout.
            FLATSHARD_ASSIGN_OR_RETURN(
                std::unique_ptr<transport::Connection> conn,
                transport::OpenDataConnection(
                    session.data_address, session.token, options_.peer_timeout, {},
                    session.tls ? PeerDataTls(options_.tls, tls_files_.ok() ? tls_files_->get() : nullptr)
                                : transport::SecureLayer()));
            // A request may wait up to peer_timeout (the peer reaching the step)
            // before it is answered.
            FLATSHARD_RETURN_IF_ERROR(conn->SetTimeout(options_.peer_timeout + absl::Seconds(10)));
            return conn;
          },
          options_.peer_timeout, stats_),
      checkpoints_(registry_, options_.rank, static_cast<int>(options_.cluster.size()), options_.checkpoint_root,
                   options_.max_file_bytes, &peers_, options_.staged_load_timeout),
      ipc_(registry_, driver_, stats_),
      nccl_(registry_, driver_, stats_, options_.nccl_timeout) {}

Server::~Server() { Shutdown(); }

absl::Status Server::Start() {
  FLATSHARD_RETURN_IF_ERROR(ValidateServerOptions(options_));
  FLATSHARD_RETURN_IF_ERROR(tls_files_.status());
  std::string host;
  int port = 0;
  FLATSHARD_RETURN_IF_ERROR(transport::SplitHostPort(options_.listen, host, port));
  std::string data_host = host;
  int data_port = port + 1;
  if (!options_.data_listen.empty()) {
    FLATSHARD_RETURN_IF_ERROR(transport::SplitHostPort(options_.data_listen, data_host, data_port));
  } else if (port == 0) {
    data_port = 0;
  }
  FLATSHARD_RETURN_IF_ERROR(ipc_.Start(memory_tier()));
  FLATSHARD_RETURN_IF_ERROR(nccl_.Start(memory_tier()));
  DataServerOptions data_options = options_.data;
  if (options_.tls.data_plane) data_options.secure = DataServerTls(options_.tls, tls_files_->get());
  data_ = std::make_unique<DataServer>(registry_, driver_, ipc_, nccl_, sessions_, stats_, std::move(data_options));
  FLATSHARD_RETURN_IF_ERROR(data_->Start(data_host, data_port));
  std::string metrics_address;
  if (!options_.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> metrics = MetricsEndpoint::Start(
        options_.metrics_listen, options_.metrics_token.empty() ? options_.auth_token : options_.metrics_token,
        options_.tls, tls_files_->get(), [this]() -> std::optional<v1::ServerStatus> {
          FlatshardService* service = serving_.load();
          if (service == nullptr) return std::nullopt;
          return service->Status();
        });
    if (!metrics.ok()) {
      data_->Stop();
      return metrics.status();
    }
    metrics_ = *std::move(metrics);
    metrics_address = metrics_->address();
  }

  // The chain presented now: the renewed one once it is taken. (Both were validated.)
  std::function<absl::Time()> tls_expiry;
  if (const TlsFiles* files = tls_files_->get()) {
    tls_expiry = [files] { return files->expiry(); };
  } else if (options_.tls.enabled()) {
    tls_expiry = [expiry = tls::CertificateChainExpiry(options_.tls.cert_chain).value_or(absl::UnixEpoch())] {
      return expiry;
    };
  }
  ServiceIdentity identity{.rank = options_.rank,
                           .cluster = options_.cluster,
                           .control_address = options_.listen,
                           .data_address = AdvertisedDataAddress(host, data_host, data_->port()),
                           .memory = options_.memory,
                           .gpu_uuid = ipc_.gpu_uuid(),
                           .auth_token = options_.auth_token,
                           .tls = options_.tls.enabled(),
                           .tls_client_certificates = options_.tls.requires_client_certificates(),
                           .data_tls = options_.tls.data_plane,
                           .tls_expiry = std::move(tls_expiry),
                           .compute_threads = compute_pool_->threads(),
                           .metrics_address = metrics_address};
  service_ = std::make_unique<FlatshardService>(std::move(identity), registry_, clip_, checkpoints_, sessions_,
                                                stats_, nccl_, [this] { return cluster_check(); });
  serving_.store(service_.get());
  // grpc.health.v1.Health, without the token (probes such as Kubernetes' grpc one send
  // none): SERVING while the control plane takes calls.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second server on this address would start too
  // and take half of the connections. It must fail instead, as the data port does.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  AcceptKeepalive(builder);  // clients and peers ping while their checkpoint calls run
  builder.AddListeningPort(options_.listen, ServerCredentials(options_.tls, tls_files_->get()), &control_port_);
  builder.RegisterService(service_.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<RequestLogFactory>(stats_));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.SetMaxReceiveMessageSize(16 << 20);
  if (options_.threads > 0) {
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
                                options_.threads);
  }
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || control_port_ == 0) {
    metrics_.reset();
    data_->Stop();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen,
                                               " (address in use or not local)"));
  }
  grpc_server_->GetHealthCheckService()->SetServingStatus(v1::Flatshard::service_full_name(), true);
  cluster_check_thread_ = std::thread([this] { CheckCluster(); });
  held_back_thread_ = std::thread([this] {
    while (!stopping_.WaitForNotificationWithTimeout(LogThrottle::kPeriod)) LogHeldBack(absl::Now());
  });
  return absl::OkStatus();
}

void Server::LogHeldBack(absl::Time now) {
  for (const auto& [kind, count] : stats_.warnings.TakeHeldBack(now)) {
    spdlog::warn("held back: {} more warnings of '{}' after the last one logged", count, kind);
  }
  LogHeldBackGrpcLines(now);
}

void Server::CheckCluster() {
  const int servers = static_cast<int>(options_.cluster.size());
  std::vector<bool> answered(servers, false);
  answered[options_.rank] = true;
  int remaining = servers - 1;
  while (remaining > 0 && !stopping_.HasBeenNotified()) {
    for (int peer = 0; peer < servers; ++peer) {
      if (answered[peer]) continue;
      const absl::Status agreed = peers_.CheckAgreement(peer, absl::Seconds(1));
      if (absl::IsFailedPrecondition(agreed) || absl::IsUnauthenticated(agreed)) {
        spdlog::error("cluster mismatch: {}", std::string(agreed.message()));
        absl::MutexLock lock(&check_mu_);
        cluster_check_ = absl::StrCat("mismatch: ", agreed.message());
        return;
      }
      if (agreed.ok()) {
        answered[peer] = true;
        --remaining;
      }
    }
    if (remaining > 0) stopping_.WaitForNotificationWithTimeout(absl::Milliseconds(200));
  }
  if (remaining == 0) {
    if (servers > 1) spdlog::info("every peer agrees on the cluster of {} servers", servers);
    absl::MutexLock lock(&check_mu_);
    cluster_check_ = "agreed";
  }
}

std::string Server::cluster_check() const {
  absl::MutexLock lock(&check_mu_);
  return cluster_check_;
}

std::string Server::ReloadTls() {
  if (!options_.tls.enabled()) return "no TLS files to read (plaintext gRPC)";
  TlsFiles* files = tls_files_.ok() ? tls_files_->get() : nullptr;
  if (files == nullptr) return "the TLS files are read once (--tls_reload_interval=0): restart to take new ones";
  return files->Reload() ? "the TLS files were read again and their changes taken"
                         : "the TLS files were read again: nothing new taken";
}

void Server::Shutdown() {
  if (!stopping_.HasBeenNotified()) stopping_.Notify();
  if (cluster_check_thread_.joinable()) cluster_check_thread_.join();
  if (held_back_thread_.joinable()) held_back_thread_.join();
  metrics_.reset();  // waits for scrapes in progress
  const absl::Status stopping = absl::UnavailableError(absl::StrCat("server ", options_.rank, " is shutting down"));
  if (grpc_server_) {  // no call starts from now on, and health checks answer NOT_SERVING
    service_->Stop(stopping);
    grpc_server_->GetHealthCheckService()->SetServingStatus(false);
  }
  // Requests waiting (for a version, a norm, a step) end now: neither the gRPC server's
  // cancellation nor a data connection's shutdown reaches a thread that waits, which would
  // otherwise hold the shutdown until its client's deadline.
  registry_.Stop(stopping);
  clip_.Stop(stopping);
  if (grpc_server_) {
    // The calls in progress get the grace to finish, and are cancelled after it. gRPC's
    // own graceful shutdown would also wait for every open connection to close, and an
    // idle gRPC client reads its socket only every few seconds (its backup poller): a
    // connected worker or peer with no call would hold the shutdown for the whole grace.
    stats_.rpcs_in_flight.AwaitNone(absl::Now() + options_.shutdown_grace);
    grpc_server_->Shutdown(std::chrono::system_clock::now());
    grpc_server_->Wait();
    grpc_server_.reset();
  }
  if (data_) data_->Stop();
  driver_.Stop();  // a send to a hung peer would hold up the destructor
  LogHeldBack(absl::InfiniteFuture());  // no request is refused from here on
}

}  // namespace flatshard::server
