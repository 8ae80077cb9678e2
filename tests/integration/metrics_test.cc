// The Prometheus endpoint (--metrics_listen, server/metrics.h) of real servers: a scrape
// says what GetStatus says after training, asks for the cluster's token, and a server
// whose metrics address is taken or malformed refuses to start.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cluster_status.h"
#include "proto/cluster_info.h"
#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

// Sends `request` as it is to 127.0.0.1:`port`, closes the sending side and returns
// everything answered until the server closes (at most 10 s).
std::string Exchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const timeval timeout{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return "connect failed";
  }
  // The server may answer and close before taking all of a bad request: no SIGPIPE.
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  shutdown(fd, SHUT_WR);
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) answer.append(buffer, static_cast<size_t>(n));
  close(fd);
  return answer;
}

// The whole answer (status line, headers, body) of `GET /metrics` at 127.0.0.1:`port`,
// with basic auth for `password` unless empty.
std::string Scrape(int port, const std::string& password) {
  std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n";
  if (!password.empty()) {
    absl::StrAppend(&request, "Authorization: Basic ", absl::Base64Escape("prometheus:" + password), "\r\n");
  }
  return Exchange(port, request + "\r\n");
}

// Each sample of a scrape's body by its name and labels as written:
// `flatshard_group_version{job="m",group="g"}` -> 2.
std::map<std::string, double> Samples(const std::string& answer) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(answer, '\n')) {
    if (line.empty() || line[0] == '#' || !absl::StartsWith(line, "flatshard_")) continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    if (space != absl::string_view::npos && absl::SimpleAtod(line.substr(space + 1), &value)) {
      samples[std::string(line.substr(0, space))] = value;
    }
  }
  return samples;
}

int PortOf(const std::string& address) {
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
  return port;
}

TEST(MetricsTest, AScrapeSaysWhatTheStatusSaysAndAsksForTheToken) {
  testing::TestCluster cluster(2, "metrics-token", ::testing::TempDir(), "",
                               {{"--metrics_listen=127.0.0.1:0"}, {"--metrics_listen=127.0.0.1:0"}});
  auto client = cluster.Connect(0, 1, "m");
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({.max_grad_norm = 100.0}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, AdamOptions{});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE((*client)->InitGroupFromSeed("g", 1).ok());
  std::vector<float> params((*layout)->padded_numel()), grad((*layout)->padded_numel(), 0.5f);
  for (int64_t step = 0; step < 2; ++step) {
    ASSERT_TRUE((*client)
                    ->Gather("g", step, DType::kFloat32,
                             absl::MakeSpan(reinterpret_cast<std::byte*>(params.data()), params.size() * 4))
                    .get()
                    .ok());
    ASSERT_TRUE((*client)
                    ->Scatter("g", step, DType::kFloat32,
                              absl::MakeConstSpan(reinterpret_cast<const std::byte*>(grad.data()), grad.size() * 4))
                    .get()
                    .ok());
  }
  ASSERT_TRUE((*client)->WaitVersion("g", 2).ok());
  for (const std::string& address : cluster.addresses()) {  // refused calls, counted by method and code
    auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 3; ++i) {
      grpc::ClientContext context;
      context.AddMetadata("authorization", "Bearer not-the-token");
      v1::ServerStatus refused;
      ASSERT_FALSE(stub->GetStatus(&context, v1::GetStatusRequest(), &refused).ok());
    }
  }

  // A data request's latency is recorded once its answer is sent, so the last scatter's
  // may come just after the worker has its answer: wait until every server's histograms
  // have counted every request.
  const auto all_timed = [](const absl::StatusOr<v1::ServerStatus>& status) {
    if (!status.ok()) return true;  // the assertions below say why
    int64_t timed = 0;
    for (const v1::NamedLatency& op : status->data_request_seconds()) {
      if (op.name() == "gather" || op.name() == "scatter") timed += static_cast<int64_t>(op.seconds().count());
    }
    return timed >= status->gathers() + status->scatters();
  };
  std::vector<absl::StatusOr<v1::ServerStatus>> statuses;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(10); absl::Now() < deadline;) {
    statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()});
    if (std::all_of(statuses.begin(), statuses.end(), all_timed)) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  for (const auto& status : statuses) {
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_THAT(status->metrics_address(), ::testing::StartsWith("127.0.0.1:"));
    const int port = PortOf(status->metrics_address());
    const std::string answer = Scrape(port, cluster.token());
    ASSERT_THAT(answer, ::testing::StartsWith("HTTP/1.1 200")) << answer;
    const std::map<std::string, double> samples = Samples(answer);
    const auto value = [&](const std::string& sample) {
      const auto it = samples.find(sample);
      EXPECT_NE(it, samples.end()) << sample << " is missing from\n" << answer;
      return it == samples.end() ? -1.0 : it->second;
    };
    const std::string server = absl::StrCat("server ", status->rank());
    EXPECT_EQ(value(absl::StrCat("flatshard_server_info{rank=\"", status->rank(), "\",memory=\"", status->memory(),
                                 "\",version=\"", FlatshardVersion(), "\",protocol=\"", kProtocolRevision, "\",nccl=\"",
                                 status->nccl_version(), "\",tls=\"no\"}")),
              1)
        << server;
    EXPECT_EQ(value("flatshard_gathers_total{plane=\"tcp\"}"), status->gathers()) << server;
    EXPECT_EQ(value("flatshard_scatters_total{plane=\"tcp\"}"), status->scatters()) << server;
    EXPECT_EQ(value("flatshard_gathers_total{plane=\"ipc\"}"), 0) << server;
    EXPECT_EQ(value("flatshard_sent_bytes_total{to=\"workers\"}"), status->bytes_sent()) << server;
    EXPECT_EQ(value("flatshard_received_bytes_total{from=\"workers\"}"), status->bytes_received()) << server;
    EXPECT_GT(status->bytes_received(), 0) << server;
    ASSERT_EQ(status->groups_size(), 1);
    EXPECT_EQ(value("flatshard_group_version{job=\"m\",group=\"g\"}"), 2) << server;
    EXPECT_EQ(value("flatshard_group_bytes{job=\"m\",group=\"g\"}"), status->groups(0).bytes()) << server;
    EXPECT_EQ(value("flatshard_group_shard_numel{job=\"m\",group=\"g\"}"), 500) << server;
    EXPECT_EQ(value("flatshard_job_workers{job=\"m\"}"), 1) << server;
    ASSERT_EQ(status->jobs_size(), 1);
    // The text format keeps 16 significant digits: the last bit may differ.
    EXPECT_DOUBLE_EQ(value("flatshard_job_last_grad_norm{job=\"m\"}"), status->jobs(0).last_grad_norm()) << server;
    EXPECT_EQ(value("flatshard_job_last_grad_norm_step{job=\"m\"}"), 1) << server;
    EXPECT_EQ(value("flatshard_cluster_agreed"), 1) << server;

    // Latencies: every gather and scatter was timed, each of the group's steps reduced
    // and stepped once, and the scrape's histograms are the status's.
    std::map<std::string, v1::LatencyHistogram> data;
    for (const v1::NamedLatency& op : status->data_request_seconds()) data[op.name()] = op.seconds();
    EXPECT_EQ(data["gather"].count(), status->gathers()) << server;
    EXPECT_EQ(data["scatter"].count(), status->scatters()) << server;
    EXPECT_EQ(status->gathers(), 2) << server;
    const v1::GroupStatus& group = status->groups(0);
    EXPECT_EQ(group.reduce_seconds().count(), 2u) << server;
    EXPECT_EQ(group.optimizer_seconds().count(), 2u) << server;
    for (const auto& [name, histogram] : data) {
      const std::string labels = absl::StrCat("{op=\"", name, "\"}");
      EXPECT_EQ(value("flatshard_data_request_duration_seconds_count" + labels), histogram.count()) << server;
      EXPECT_EQ(value(absl::StrCat("flatshard_data_request_duration_seconds_bucket{op=\"", name, "\",le=\"+Inf\"}")),
                histogram.count())
          << server;
      EXPECT_DOUBLE_EQ(value("flatshard_data_request_duration_seconds_sum" + labels), histogram.sum_seconds())
          << server;
      // Cumulative at each bound: the counts up to it.
      std::map<double, double> buckets;  // le -> count, the finite ones
      const std::string prefix = absl::StrCat("flatshard_data_request_duration_seconds_bucket{op=\"", name, "\",le=\"");
      for (const auto& [sample, count] : samples) {
        double le = 0;
        if (absl::StartsWith(sample, prefix) &&
            absl::SimpleAtod(absl::StripSuffix(sample.substr(prefix.size()), "\"}"), &le) && std::isfinite(le)) {
          buckets[le] = count;
        }
      }
      ASSERT_EQ(buckets.size(), static_cast<size_t>(histogram.upper_bounds_seconds_size())) << server;
      uint64_t cumulative = 0;
      for (int i = 0; i < histogram.upper_bounds_seconds_size(); ++i) {
        cumulative += histogram.counts(i);
        EXPECT_EQ(buckets[histogram.upper_bounds_seconds(i)], cumulative) << server << " " << name << " le " << i;
      }
    }
    EXPECT_EQ(value("flatshard_group_optimizer_duration_seconds_count{job=\"m\",group=\"g\"}"), 2) << server;
    EXPECT_EQ(value("flatshard_group_reduce_duration_seconds_count{job=\"m\",group=\"g\"}"), 2) << server;
    // Control-plane calls by method: the group was registered once on each server.
    std::map<std::string, uint64_t> rpcs;
    for (const v1::NamedLatency& rpc : status->rpc_seconds()) rpcs[rpc.name()] = rpc.seconds().count();
    EXPECT_EQ(rpcs["flatshard.v1.Flatshard/RegisterGroup"], 1u) << server;
    EXPECT_EQ(rpcs["flatshard.v1.Flatshard/ConfigureJob"], 1u) << server;
    EXPECT_EQ(value("flatshard_rpc_duration_seconds_count{method=\"flatshard.v1.Flatshard/RegisterGroup\"}"), 1)
        << server;
    EXPECT_EQ(value("flatshard_rpc_errors_total{method=\"flatshard.v1.Flatshard/GetStatus\",code=\"UNAUTHENTICATED\"}"),
              3)
        << server;

    EXPECT_THAT(Scrape(port, ""), ::testing::StartsWith("HTTP/1.1 401")) << server;
    const std::string wrong = Scrape(port, "not-the-token");
    EXPECT_THAT(wrong, ::testing::StartsWith("HTTP/1.1 401")) << server;
    EXPECT_THAT(wrong, ::testing::Not(HasSubstr("flatshard_"))) << server;
  }

  // Another server on a metrics address in use exits; so does one with a malformed one.
  const std::string taken =
      (*FetchClusterStatus({.servers = {cluster.addresses()[0]}, .token = cluster.token()})[0]).metrics_address();
  EXPECT_TRUE(testing::RefusesToStart({"--metrics_listen=" + taken}));
  EXPECT_TRUE(testing::RefusesToStart({"--metrics_listen=no-port-here"}));
}

// Whatever arrives at the metrics port (bytes that are no HTTP, other paths and
// methods, a huge header, a request cut short), the server answers or closes, and goes on
// serving scrapes and its control plane.
TEST(MetricsTest, GarbageAtTheMetricsPortLeavesTheServerServing) {
  testing::TestCluster cluster(1, "metrics-token", ::testing::TempDir(), "", {{"--metrics_listen=127.0.0.1:0"}});
  const ClientOptions options{.servers = cluster.addresses(), .token = cluster.token()};
  const auto status = FetchClusterStatus(options)[0];
  ASSERT_TRUE(status.ok()) << status.status();
  const int port = PortOf(status->metrics_address());
  const std::string auth =
      absl::StrCat("Authorization: Basic ", absl::Base64Escape("prometheus:" + cluster.token()), "\r\n");
  std::mt19937 random(7);
  std::string noise(64 << 10, '\0');
  for (char& c : noise) c = static_cast<char>(random());
  const std::vector<std::string> requests = {
      noise,
      "GET /other HTTP/1.0\r\n" + auth + "\r\n",
      "POST /metrics HTTP/1.0\r\nContent-Length: 5\r\n" + auth + "\r\nhello",
      "GET /metrics HTTP/1.0\r\nX-Long: " + std::string(200 << 10, 'x') + "\r\n" + auth + "\r\n",
      "GET /metrics HTTP/1.0\r\nAuthorization: Basic !!!not-base64!!!\r\n\r\n",
      "GET /metr",
      "",
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    (void)Exchange(port, requests[i]);
    const std::string scraped = Scrape(port, cluster.token());
    EXPECT_THAT(scraped, ::testing::StartsWith("HTTP/1.1 200")) << "after request " << i;
    EXPECT_THAT(scraped, HasSubstr("flatshard_server_info{rank=\"0\"")) << "after request " << i;
  }
  EXPECT_THAT(Exchange(port, "GET /other HTTP/1.0\r\n" + auth + "\r\n"), HasSubstr(" 404 Not Found\r\n"));
  EXPECT_TRUE(FetchClusterStatus(options)[0].ok());
}

// With --metrics_token_file, scrapes present that token and not the cluster's (which then
// never needs to be in the scraper's hands); a metrics token without metrics, or an
// empty one, stops the server at start-up.
TEST(MetricsTest, AMetricsTokenOfItsOwnKeepsTheClusterTokenOffScrapes) {
  const testing::ScratchDir scratch("metrics-token");
  const std::string token_file = scratch.path() + "/metrics-token";
  std::ofstream(token_file) << "scrape-token\n";
  testing::TestCluster cluster(1, "cluster-token", ::testing::TempDir(), "",
                               {{"--metrics_listen=127.0.0.1:0", "--metrics_token_file=" + token_file}});
  const auto status = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})[0];
  ASSERT_TRUE(status.ok()) << status.status();
  const int port = PortOf(status->metrics_address());
  const std::string scraped = Scrape(port, "scrape-token");
  EXPECT_THAT(scraped, ::testing::StartsWith("HTTP/1.1 200")) << scraped;
  EXPECT_THAT(scraped, HasSubstr("flatshard_server_info{rank=\"0\""));
  EXPECT_THAT(Scrape(port, cluster.token()), ::testing::StartsWith("HTTP/1.1 401"));
  EXPECT_THAT(Scrape(port, ""), ::testing::StartsWith("HTTP/1.1 401"));

  EXPECT_TRUE(testing::RefusesToStart({"--metrics_token_file=" + token_file}));
  const std::string empty_file = scratch.path() + "/empty";
  std::ofstream(empty_file) << "\n";
  EXPECT_TRUE(testing::RefusesToStart({"--metrics_listen=127.0.0.1:0", "--metrics_token_file=" + empty_file}));
  EXPECT_TRUE(
      testing::RefusesToStart({"--metrics_listen=127.0.0.1:0", "--metrics_token_file=" + scratch.path() + "/none"}));
}

// Without --metrics_listen nothing is served, and the status says so.
TEST(MetricsTest, NoMetricsUnlessAsked) {
  testing::TestCluster cluster(1, "metrics-token", ::testing::TempDir());
  const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()});
  ASSERT_TRUE(statuses[0].ok()) << statuses[0].status();
  EXPECT_EQ(statuses[0]->metrics_address(), "");
}

}  // namespace
}  // namespace flatshard
