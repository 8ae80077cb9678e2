#include "server/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <atomic>
#include <exception>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/cluster_info.h"
#include "server/auth.h"
#include "server/https_relay.h"
#include "server/tls_files.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

// Builds one family's samples.
class Family {
 public:
  Family(std::string name, std::string help, MetricType type) {
    family_.name = std::move(name);
    family_.help = std::move(help);
    family_.type = type;
  }
  Family& Add(double value, Labels labels = {}) {
    ClientMetric metric;
    metric.label = std::move(labels);
    (family_.type == MetricType::Counter ? metric.counter.value : metric.gauge.value) = value;
    family_.metric.push_back(std::move(metric));
    return *this;
  }
  // A histogram family's sample: cumulative buckets, the last one +Inf.
  Family& Add(const v1::LatencyHistogram& histogram, Labels labels) {
    ClientMetric metric;
    metric.label = std::move(labels);
    metric.histogram.sample_count = histogram.count();
    metric.histogram.sample_sum = histogram.sum_seconds();
    uint64_t cumulative = 0;
    for (int i = 0; i < histogram.counts_size(); ++i) {
      cumulative += histogram.counts(i);
      metric.histogram.bucket.push_back({cumulative, i < histogram.upper_bounds_seconds_size()
                                                         ? histogram.upper_bounds_seconds(i)
                                                         : std::numeric_limits<double>::infinity()});
    }
    family_.metric.push_back(std::move(metric));
    return *this;
  }
  MetricFamily Take() { return std::move(family_); }

 private:
  MetricFamily family_;
};

Labels GroupLabels(const v1::GroupStatus& g) { return {{"job", g.job()}, {"group", g.group()}}; }

}  // namespace

std::vector<MetricFamily> StatusMetrics(const v1::ServerStatus& s) {
  std::vector<MetricFamily> families;
  auto add = [&](Family& family) {
    MetricFamily taken = family.Take();
    if (!taken.metric.empty()) families.push_back(std::move(taken));  // no job, no group: no family
  };
  const std::string rank = absl::StrCat(s.rank());

  Family info("flatshard_server_info", "This server: its rank, memory tier and release (always 1).", MetricType::Gauge);
  add(info.Add(1, {{"rank", rank},
                   {"memory", s.memory()},
                   {"version", std::string(FlatshardVersion())},
                   {"protocol", absl::StrCat(kProtocolRevision)},
                   {"nccl", s.nccl_version()},
                   {"tls", s.tls() ? "yes" : "no"}}));
  if (s.tls()) {
    Family expiry("flatshard_tls_certificate_expiry_timestamp_seconds",
                  "When the TLS certificate chain presented now expires (its earliest notAfter), in seconds "
                  "since the Unix epoch.",
                  MetricType::Gauge);
    add(expiry.Add(static_cast<double>(s.tls_expiry_unix_seconds())));
  }
  Family uptime("flatshard_uptime_seconds", "Seconds since this server started.", MetricType::Gauge);
  add(uptime.Add(s.uptime_seconds()));
  Family agreed("flatshard_cluster_agreed",
                "1 once every peer reports the same cluster list, 0 while checking or on a mismatch.",
                MetricType::Gauge);
  add(agreed.Add(s.cluster_check() == "agreed" ? 1 : 0));

  // Requests by data plane: TCP is what neither IPC nor NCCL carried.
  Family gathers("flatshard_gathers_total", "Gathers answered, by data plane.", MetricType::Counter);
  gathers.Add(static_cast<double>(s.gathers() - s.ipc_gathers() - s.nccl_gathers()), {{"plane", "tcp"}})
      .Add(static_cast<double>(s.ipc_gathers()), {{"plane", "ipc"}})
      .Add(static_cast<double>(s.nccl_gathers()), {{"plane", "nccl"}});
  add(gathers);
  Family scatters("flatshard_scatters_total", "Scatters (gradient contributions) taken, by data plane.",
                  MetricType::Counter);
  scatters.Add(static_cast<double>(s.scatters() - s.ipc_scatters() - s.nccl_scatters()), {{"plane", "tcp"}})
      .Add(static_cast<double>(s.ipc_scatters()), {{"plane", "ipc"}})
      .Add(static_cast<double>(s.nccl_scatters()), {{"plane", "nccl"}});
  add(scatters);
  Family errors("flatshard_request_errors_total", "Data-plane requests answered with an error.", MetricType::Counter);
  add(errors.Add(static_cast<double>(s.errors())));
  Family sent("flatshard_sent_bytes_total",
              "Tensor bytes sent: to workers (gathers), and to peers in a hybrid job's exchange.", MetricType::Counter);
  sent.Add(static_cast<double>(s.bytes_sent()), {{"to", "workers"}})
      .Add(static_cast<double>(s.exchange_bytes_sent()), {{"to", "peers"}});
  add(sent);
  Family received("flatshard_received_bytes_total",
                  "Tensor bytes received: from workers (scatters), and from peers in a hybrid job's exchange.",
                  MetricType::Counter);
  received.Add(static_cast<double>(s.bytes_received()), {{"from", "workers"}})
      .Add(static_cast<double>(s.exchange_bytes_received()), {{"from", "peers"}});
  add(received);
  Family connections("flatshard_data_connections", "Data-plane connections open now.", MetricType::Gauge);
  add(connections.Add(s.open_data_connections()));
  Family in_flight("flatshard_requests_in_flight", "Requests being served now (waiting ones among them), by plane.",
                   MetricType::Gauge);
  in_flight.Add(s.data_requests_in_flight(), {{"plane", "data"}}).Add(s.rpcs_in_flight(), {{"plane", "control"}});
  add(in_flight);

  Family workers("flatshard_job_workers", "Workers of each configured job.", MetricType::Gauge);
  Family norm("flatshard_job_last_grad_norm", "The last global gradient norm of a clipped job (absent before one).",
              MetricType::Gauge);
  Family norm_step("flatshard_job_last_grad_norm_step", "The step the last gradient norm belongs to.",
                   MetricType::Gauge);
  Family skipped("flatshard_job_skipped_steps_total", "Non-finite steps skipped since this server started.",
                 MetricType::Counter);
  for (const v1::JobStatus& job : s.jobs()) {
    const Labels labels{{"job", job.job()}};
    workers.Add(job.num_workers(), labels);
    if (job.last_norm_step() >= 0) {
      norm.Add(job.last_grad_norm(), labels);
      norm_step.Add(static_cast<double>(job.last_norm_step()), labels);
    }
    skipped.Add(static_cast<double>(job.skipped_steps()), labels);
  }
  for (Family* family : {&workers, &norm, &norm_step, &skipped}) add(*family);

  Family version("flatshard_group_version", "Optimizer steps applied to the group (its version).", MetricType::Gauge);
  Family bytes("flatshard_group_bytes",
               "Memory the group holds on this server: parameters, gradient, optimizer state, staging, snapshots "
               "and exchange buffers.",
               MetricType::Gauge);
  Family numel("flatshard_group_shard_numel", "Elements of this server's shard of the group, padding included.",
               MetricType::Gauge);
  Family pending("flatshard_group_pending_contributions", "Gradient contributions waiting for the group's step.",
                 MetricType::Gauge);
  Family reduce("flatshard_group_reduce_duration_seconds",
                "Reducing a step's gradient contributions on this server (hybrid jobs: the replica group's partial).",
                MetricType::Histogram);
  Family optimizer("flatshard_group_optimizer_duration_seconds",
                   "Running the optimizer over this server's shard, per step.", MetricType::Histogram);
  for (const v1::GroupStatus& g : s.groups()) {
    version.Add(static_cast<double>(g.version()), GroupLabels(g));
    bytes.Add(static_cast<double>(g.bytes()), GroupLabels(g));
    numel.Add(static_cast<double>(g.shard_numel()), GroupLabels(g));
    pending.Add(g.pending_contributions(), GroupLabels(g));
    reduce.Add(g.reduce_seconds(), GroupLabels(g));
    optimizer.Add(g.optimizer_seconds(), GroupLabels(g));
  }
  for (Family* family : {&version, &bytes, &numel, &pending, &reduce, &optimizer}) add(*family);

  Family data_requests("flatshard_data_request_duration_seconds",
                       "Data-plane requests by op, from their header's arrival to the answer sent (a gather waits "
                       "for its version, a sync scatter for the step).",
                       MetricType::Histogram);
  for (const v1::NamedLatency& op : s.data_request_seconds()) data_requests.Add(op.seconds(), {{"op", op.name()}});
  add(data_requests);
  Family rpcs("flatshard_rpc_duration_seconds",
              "Control-plane RPCs by method, from their arrival to their status sent.", MetricType::Histogram);
  for (const v1::NamedLatency& rpc : s.rpc_seconds()) rpcs.Add(rpc.seconds(), {{"method", rpc.name()}});
  add(rpcs);
  Family rpc_errors("flatshard_rpc_errors_total",
                    "Control-plane RPCs answered with an error, by method and code (UNAUTHENTICATED: a wrong token).",
                    MetricType::Counter);
  for (const v1::RpcErrorCount& error : s.rpc_errors()) {
    rpc_errors.Add(static_cast<double>(error.count()), {{"method", error.method()}, {"code", error.code()}});
  }
  add(rpc_errors);

  Family staged("flatshard_staged_load_bytes",
                "Memory of checkpoint loads read here and waiting for their commit (until --staged_load_timeout).",
                MetricType::Gauge);
  for (const v1::StagedLoad& load : s.staged_loads()) {
    staged.Add(static_cast<double>(load.bytes()), {{"job", load.job()}, {"checkpoint", load.name()}});
  }
  add(staged);
  Family done("flatshard_checkpoint_done_bytes", "Tensor bytes written (save) or read (load) so far.",
              MetricType::Gauge);
  Family total("flatshard_checkpoint_total_bytes", "Tensor bytes of this server's part of the save or load.",
               MetricType::Gauge);
  for (const v1::CheckpointProgress& p : s.checkpoints_in_progress()) {
    const Labels labels{{"checkpoint", p.name()}, {"operation", p.operation()}};
    done.Add(static_cast<double>(p.done()), labels);
    total.Add(static_cast<double>(p.total()), labels);
  }
  add(done);
  add(total);
  return families;
}

class MetricsEndpoint::Collector : public prometheus::Collectable {
 public:
  explicit Collector(std::function<std::optional<v1::ServerStatus>()> status) : status_(std::move(status)) {}
  std::vector<MetricFamily> Collect() const override {
    const std::optional<v1::ServerStatus> status = status_();
    return status.has_value() ? StatusMetrics(*status) : std::vector<MetricFamily>{};
  }

 private:
  const std::function<std::optional<v1::ServerStatus>()> status_;
};

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& address, const std::string& auth_token, const TlsOptions& tls, const TlsFiles* tls_files,
    std::function<std::optional<v1::ServerStatus>()> status) {
  std::string host;
  int port = 0;
  if (absl::Status split = transport::SplitHostPort(address, host, port); !split.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_listen=", address, ": ", split.message()));
  }
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  // Behind the relay civetweb takes plain HTTP from this host only.
  const std::string exposer_host = tls.enabled() ? "127.0.0.1" : host;
  try {
    // civetweb: one listening socket; port 0 picks a free one.
    endpoint->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", absl::StrCat(exposer_host, ":", tls.enabled() ? 0 : port), "num_threads", "2"});
  } catch (const std::exception& error) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, " (address in use or not local): ", error.what()));
  }
  const std::vector<int> ports = endpoint->exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address));
  endpoint->exposer_address_ = absl::StrCat(exposer_host, ":", ports.front());
  endpoint->port_ = ports.front();
  if (tls.enabled()) {
    absl::StatusOr<std::unique_ptr<HttpsRelay>> relay = HttpsRelay::Start(host, port, tls, tls_files, ports.front());
    if (!relay.ok()) {
      return absl::Status(relay.status().code(),
                          absl::StrCat("cannot serve metrics on ", address, ": ", relay.status().message()));
    }
    endpoint->relay_ = *std::move(relay);
    endpoint->port_ = endpoint->relay_->port();
  }
  endpoint->address_ = absl::StrCat(host, ":", endpoint->port_);
  if (!auth_token.empty()) {
    endpoint->exposer_->RegisterAuth(
        [auth_token](const std::string&, const std::string& password) {
          return ConstantTimeEquals(password, auth_token);
        },
        "flatshard");
  }
  endpoint->collector_ = std::make_shared<Collector>(std::move(status));
  endpoint->exposer_->RegisterCollectable(endpoint->collector_);
  return endpoint;
}

std::string MetricsEndpoint::url() const {
  return absl::StrCat(relay_ != nullptr ? "https://" : "http://", address_, "/metrics");
}

MetricsEndpoint::~MetricsEndpoint() {
  relay_.reset();  // no scrape reaches civetweb any more
  // civetweb's listener polls in 2 s quanta before it sees that it is stopping; a
  // connection wakes it at once, so the server stops without that wait.
  std::atomic<bool> stopped{false};
  std::thread waker([&] {
    std::string host;
    int port = 0;
    if (!transport::SplitHostPort(exposer_address_, host, port).ok()) return;
    if (host == "0.0.0.0") host = "127.0.0.1";
    while (!stopped.load()) {
      (void)transport::ConnectTcp(host, port, absl::Milliseconds(100));
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  exposer_.reset();  // stops civetweb's threads before the collector goes
  stopped.store(true);
  waker.join();
}

}  // namespace flatshard::server
