// Metrics: a server's counters and gauges for Prometheus, served at /metrics on
// --metrics_listen by prometheus-cpp's Exposer (civetweb): over HTTPS with this server's
// certificate when its control plane speaks TLS (an HttpsRelay in front of an Exposer on
// 127.0.0.1), plain HTTP otherwise. Every scrape reads what the GetStatus RPC answers
// (v1::ServerStatus, through `status`; none yet: an empty scrape), so the two never
// disagree and nothing is counted twice. With a token, a scrape must present it as the
// password of HTTP basic auth (any user name); otherwise the endpoint is open, so bind it
// where only the scraper reaches. No tensor bytes are ever exposed.
//
// Thread-safe: scrapes run on the Exposer's threads and only call `status`.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto metrics, MetricsEndpoint::Start("0.0.0.0:9400", token, tls,
//                                                                   [&] { return service.Status(); }));
#ifndef FLATSHARD_SERVER_METRICS_H_
#define FLATSHARD_SERVER_METRICS_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/flatshard.pb.h"
#include "server/tls.h"

namespace prometheus {
class Exposer;
struct MetricFamily;
}  // namespace prometheus

namespace flatshard::server {

class HttpsRelay;  // server/https_relay.h

// The metric families that `status` gives, all named flatshard_*: traffic and request
// counters (by data plane), data connections, uptime, the cluster check, and per job
// and group their versions, memory, pending contributions and norms; staged loads and
// checkpoint saves and loads in progress. Pure.
std::vector<prometheus::MetricFamily> StatusMetrics(const v1::ServerStatus& status);

class MetricsEndpoint {
 public:
  // Serves StatusMetrics(status()) at `address`/metrics (HOST:PORT; port 0 picks one),
  // over HTTPS when `tls` is enabled (with `tls_files`' current pair when not null; they
  // outlive the endpoint). Unavailable when `address` cannot be bound;
  // InvalidArgument when it is not HOST:PORT. Scrapes present `auth_token` (when not
  // empty) as basic auth's password.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, const std::string& auth_token, const TlsOptions& tls, const TlsFiles* tls_files,
      std::function<std::optional<v1::ServerStatus>()> status);
  ~MetricsEndpoint();  // stops serving; waits for scrapes in progress
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const { return port_; }
  const std::string& address() const { return address_; }  // HOST:port(), as bound
  // The scrape URL: http(s)://address()/metrics.
  std::string url() const;

 private:
  class Collector;
  MetricsEndpoint() = default;

  std::shared_ptr<Collector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string exposer_address_;          // where civetweb listens: address_, or 127.0.0.1 behind the relay
  std::unique_ptr<HttpsRelay> relay_;    // with TLS
  int port_ = 0;
  std::string address_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_METRICS_H_
