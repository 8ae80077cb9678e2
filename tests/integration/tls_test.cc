// TLS on the control plane (server/tls.h): a cluster started with certificates trains a
// clipped step (its servers call each other over TLS for the norm), clients that speak
// plaintext or trust another CA are refused with a hint, the metrics endpoint speaks
// HTTPS, mutual TLS serves only callers with a certificate of its client CAs, and bad
// TLS files stop a server at start-up. The certificates are made by the openssl command line for each run.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli/status_command.h"
#include "client/cluster_status.h"
#include "core/file.h"
#include "server/log_throttle.h"
#include "tests/integration/gpu_worker.h"
#include "tests/integration/test_cluster.h"
#include "tests/run_command.h"
#include "tests/test_certificates.h"
#include "tls/tls_connection.h"
#include "transport/data_protocol.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard {
namespace {

using testing::TestCluster;

// A CA, a certificate for 127.0.0.1 signed by it with its key, and an unrelated CA.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(absl::StrCat(::testing::TempDir(), "/flatshard-tls-", getpid()));
    std::filesystem::create_directories(*dir_);
    ASSERT_TRUE(testing::MakeTestCertificates(*dir_))
        << "openssl could not make the test certificates";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  static std::string File(const std::string& name) { return absl::StrCat(*dir_, "/", name); }
  // `link` -> `version`, a new directory holding `cert` and `key` as cert.pem and
  // key.pem, swapped in at once (no reader sees one file of each), as the files of a
  // Kubernetes secret are.
  static void Publish(const std::string& link, const std::string& version, const std::string& cert,
                      const std::string& key) {
    std::filesystem::create_directories(File(version));
    std::filesystem::copy_file(File(cert), File(version + "/cert.pem"));
    std::filesystem::copy_file(File(key), File(version + "/key.pem"));
    std::filesystem::create_symlink(version, File(link + ".new"));
    std::filesystem::rename(File(link + ".new"), File(link));
  }
  // The serial of the certificate `address` presents in a handshake checked against the CA.
  static std::string Presented(const std::string& address) {
    return testing::RunCommand(absl::StrCat("timeout 20 openssl s_client -connect ", address,
                                            " -alpn h2 -CAfile '", File("ca.pem"), "' -verify_return_error "
                                            "</dev/null 2>/dev/null | openssl x509 -noout -serial"))
        .second;
  }
  static std::string SerialOf(const std::string& cert) {
    return testing::RunCommand(absl::StrCat("openssl x509 -noout -serial -in '", File(cert), "'")).second;
  }
  // `openssl s_client` sends a GET of /metrics (with basic auth for `token` unless empty)
  // to 127.0.0.1:`port`, checking its certificate against `ca` and presenting the client
  // certificate `identity`.pem (empty: none): its exit code and the answer.
  static std::pair<int, std::string> Scrape(const std::string& port, const std::string& ca, const std::string& token,
                                            const std::string& identity = "") {
    const std::string auth =
        token.empty() ? "" : absl::StrCat("Authorization: Basic ", absl::Base64Escape("prometheus:" + token), "\\r\\n");
    const std::string presented =
        identity.empty()
            ? ""
            : absl::StrCat(" -cert '", File(identity + ".pem"), "' -key '", File(identity + ".key"), "'");
    return testing::RunCommand(absl::StrCat("printf 'GET /metrics HTTP/1.0\\r\\n", auth,
                                            "\\r\\n' | timeout 20 openssl s_client -quiet -connect 127.0.0.1:", port,
                                            " -CAfile '", ca, "' -verify_return_error -verify_ip 127.0.0.1", presented,
                                            " 2>/dev/null"));
  }
  // Options of a client of `cluster` trusting ca.pem and presenting client.pem.
  static ClientOptions Presenting(const TestCluster& cluster) {
    return {.servers = cluster.addresses(),
            .token = cluster.token(),
            .timeout = absl::Seconds(20),
            .tls_ca_file = File("ca.pem"),
            .tls_cert_file = File("client.pem"),
            .tls_key_file = File("client.key")};
  }
  // The table `flatshard status` prints for `cluster`, presenting client.pem (a failure
  // of the command fails the test).
  static std::string StatusTable(const TestCluster& cluster) {
    std::ostringstream table, err;
    const cli::StatusCommandOptions options{
        .servers = cluster.addresses(),
        .token = cluster.token(),
        .tls = {.ca_file = File("ca.pem"), .cert_file = File("client.pem"), .key_file = File("client.key")}};
    EXPECT_EQ(cli::RunStatusCommand(options, table, err), 0) << err.str();
    return table.str();
  }
  static std::vector<std::string> ServerTls() {
    return {"--tls_cert_file=" + File("server.pem"), "--tls_key_file=" + File("server.key"),
            "--tls_ca_file=" + File("ca.pem")};
  }

  static std::string* dir_;
};

std::string* TlsTest::dir_ = nullptr;

// Registers a group with `client` and takes one clipped step, checked against torch's
// clip_grad_norm_: each server's share of the norm reaches the other over a peer call,
// or the step never ends.
void ExpectAClippedStep(Client& client) {
  ASSERT_TRUE(client.ConfigureJob({.max_grad_norm = 1.0}).ok());
  auto layout = client.RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE(client.InitGroupFromSeed("g", 3).ok());
  std::vector<float> before((*layout)->padded_numel()), after(before.size());
  ASSERT_TRUE(client.Gather("g", 0, DType::kFloat32, AsBytes(before)).get().ok());
  std::vector<float> grad(before.size(), 0.0f);
  std::fill_n(grad.begin(), 1000, 0.5f);  // norm 0.5 * sqrt(1000) ~ 15.8: clipped to 1
  ASSERT_TRUE(client.Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  auto version = client.Gather("g", 1, DType::kFloat32, AsBytes(after)).get();
  ASSERT_TRUE(version.ok()) << version.status();
  const double coef = 1.0 / (0.5 * std::sqrt(1000.0) + 1e-6);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_NEAR(after[i], before[i] - 0.5 * coef, 1e-6) << i;
  }
}

TEST_F(TlsTest, ClusterTrainsAClippedStepOverTls) {
  TestCluster cluster(2, "tls-token", ::testing::TempDir(), "", {ServerTls(), ServerTls()});
  auto client = cluster.Connect({.timeout = absl::Seconds(20), .tls_ca_file = File("ca.pem")});
  ASSERT_TRUE(client.ok()) << client.status();
  ExpectAClippedStep(**client);

  // The servers also checked each other over TLS at start-up.
  const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token(),
                                            .tls_ca_file = File("ca.pem")});
  for (const auto& status : statuses) {
    ASSERT_TRUE(status.ok()) << status.status();
    for (int i = 0; i < 50 && status->cluster_check() == "checking"; ++i) absl::SleepFor(absl::Milliseconds(100));
  }
  const auto rechecked = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token(),
                                             .tls_ca_file = File("ca.pem")});
  for (const auto& status : rechecked) {
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->cluster_check(), "agreed");
    EXPECT_TRUE(status->tls());
  }
}

TEST_F(TlsTest, PlaintextAndUntrustingClientsAreRefusedAndTheServerKeepsServing) {
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {ServerTls()});
  const ClientOptions trusting{.servers = cluster.addresses(), .token = cluster.token(),
                               .timeout = absl::Seconds(10), .tls_ca_file = File("ca.pem")};
  ASSERT_TRUE(cluster.Connect(trusting).ok()) << "the server did not start";

  ClientOptions plaintext = trusting;
  plaintext.tls_ca_file = "";
  absl::StatusOr<std::unique_ptr<Client>> refused = Client::Connect(plaintext);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "needs tls_ca_file")) << refused.status();

  ClientOptions untrusting = trusting;
  untrusting.tls_ca_file = File("other-ca.pem");
  refused = Client::Connect(untrusting);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "signed by that CA")) << refused.status();

  ClientOptions not_pem = trusting;
  not_pem.tls_ca_file = File("server.csr");
  refused = Client::Connect(not_pem);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  not_pem.tls_ca_file = File("missing.pem");
  refused = Client::Connect(not_pem);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();

  auto client = Client::Connect(trusting);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->ConfigureJob({}).ok());
}

// gRPC's own lines, such as a failed handshake on the TLS control port, go to the
// server's log, not its stderr: as warnings with the rank, at most a burst per period
// however many connections a scanner opens, and the server says how many it held back.
TEST_F(TlsTest, GrpcsOwnLinesGoToTheServersLogThrottled) {
  std::vector<std::string> flags = ServerTls();
  flags.push_back("--log_file=" + File("grpc-lines.log"));
  std::filesystem::remove(File("grpc-lines.log"));
  {
    TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {flags});
    std::string host;
    int port = 0;
    ASSERT_TRUE(transport::SplitHostPort(cluster.addresses()[0], host, port).ok());
    const std::string not_tls = "GET / HTTP/1.0\r\n\r\n";
    for (int i = 0; i < 3 * server::LogThrottle::kBurst; ++i) {
      auto conn = transport::ConnectTcp(host, port, absl::Seconds(5));
      ASSERT_TRUE(conn.ok()) << conn.status();
      ASSERT_TRUE((*conn)->SetTimeout(absl::Seconds(10)).ok());
      ASSERT_TRUE((*conn)->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(not_tls.data()),
                                                     not_tls.size())})
                      .ok());
      std::byte byte;
      while ((*conn)->Recv(absl::MakeSpan(&byte, 1)).ok()) {
      }  // until the server closes it
    }
    const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token(),
                                              .tls_ca_file = File("ca.pem")});
    ASSERT_TRUE(statuses[0].ok()) << "the server serves on: " << statuses[0].status();
  }
  const std::string log = ReadFileToString(File("grpc-lines.log")).value_or("");
  int handshakes = 0;
  std::string place;  // "ssl_transport_security.cc:LINE"
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (!absl::StrContains(line, "grpc: Handshake failed")) continue;
    ++handshakes;
    EXPECT_THAT(line, ::testing::HasSubstr(" rank 0 warning: grpc: Handshake failed with fatal error SSL_ERROR_SSL"));
    const size_t at = line.rfind("(ssl_transport_security.cc:");
    ASSERT_NE(at, absl::string_view::npos) << line;
    place = std::string(line.substr(at + 1, line.find(')', at) - at - 1));
  }
  EXPECT_EQ(handshakes, server::LogThrottle::kBurst) << log;
  // The scanner stopped before the period ended: the server said the rest when it stopped.
  EXPECT_THAT(log, ::testing::HasSubstr(absl::StrCat(" rank 0 warning: held back: ", 2 * server::LogThrottle::kBurst,
                                                     " more gRPC lines from ", place, " after the last one logged\n")));
}

// Beside a TLS control plane the metrics endpoint speaks HTTPS with the server's
// certificate (server/https_relay.h), so scrapes may carry the cluster token: one that
// checks the certificate against the CA gets the metrics with the token and 401 without;
// a scraper trusting another CA, and a plain-HTTP request, get nothing; the endpoint
// serves on after them, and a stopping server does not wait for a scraper that hangs.
TEST_F(TlsTest, MetricsAreServedOverHttpsWithTheServersCertificate) {
  std::vector<std::string> flags = ServerTls();
  flags.push_back("--metrics_listen=127.0.0.1:0");
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {flags});
  const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token(),
                                            .tls_ca_file = File("ca.pem")});
  ASSERT_TRUE(statuses[0].ok()) << statuses[0].status();
  const std::string address = statuses[0]->metrics_address();
  const std::string port = address.substr(address.rfind(':') + 1);
  auto scrape = [&](const std::string& ca, const std::string& token) { return Scrape(port, ca, token); };
  const auto [served, metrics] = scrape(File("ca.pem"), cluster.token());
  EXPECT_EQ(served, 0);
  EXPECT_TRUE(absl::StartsWith(metrics, "HTTP/1.1 200")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "\nflatshard_uptime_seconds ")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "flatshard_server_info{")) << metrics;
  // When the certificate expires: server.pem is valid for two days from its making.
  const int64_t expiry = statuses[0]->tls_expiry_unix_seconds();
  EXPECT_GT(absl::FromUnixSeconds(expiry), absl::Now() + absl::Hours(47));
  EXPECT_LT(absl::FromUnixSeconds(expiry), absl::Now() + absl::Hours(48));
  const std::string gauge = "\nflatshard_tls_certificate_expiry_timestamp_seconds ";
  const size_t at = metrics.find(gauge);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_EQ(std::strtod(metrics.c_str() + at + gauge.size(), nullptr), static_cast<double>(expiry)) << metrics;
  const auto [refused, unauthorized] = scrape(File("ca.pem"), "");
  EXPECT_TRUE(absl::StartsWith(unauthorized, "HTTP/1.1 401")) << unauthorized;
  const auto [untrusted, nothing] = scrape(File("other-ca.pem"), cluster.token());
  EXPECT_NE(untrusted, 0) << "a certificate the scraper's CA did not sign was accepted";
  EXPECT_FALSE(absl::StrContains(nothing, "flatshard_")) << nothing;
  {
    auto plain = transport::ConnectTcp("127.0.0.1", std::stoi(port), absl::Seconds(5));
    ASSERT_TRUE(plain.ok()) << plain.status();
    ASSERT_TRUE((*plain)->SetTimeout(absl::Seconds(10)).ok());
    const std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
    (void)(*plain)->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(request.data()), request.size())});
    std::byte first;
    EXPECT_FALSE((*plain)->Recv(absl::MakeSpan(&first, 1)).ok()) << "plain HTTP was answered";
  }
  const auto [again, metrics_again] = scrape(File("ca.pem"), cluster.token());
  EXPECT_TRUE(absl::StartsWith(metrics_again, "HTTP/1.1 200")) << metrics_again;
  // A server told to stop cuts a scraper that never finishes its handshake rather than
  // wait for its 10 s timeout.
  auto idle = transport::ConnectTcp("127.0.0.1", std::stoi(port), absl::Seconds(5));
  ASSERT_TRUE(idle.ok()) << idle.status();
  absl::SleepFor(absl::Milliseconds(200));  // accepted, in its handshake
  const auto [status, took] = cluster.Terminate(0, absl::Seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_LT(took, absl::Seconds(5));
}

// A certificate renewed on disk (both files replaced at once, through a symlink as a
// Kubernetes secret's are) is served by the control plane and the metrics endpoint
// within a reload interval, without a restart, and clients carry on; a renewal whose key
// is not its certificate's (a file replaced before the other) is ignored by both, the
// last good pair staying in use.
TEST_F(TlsTest, ARenewedCertificateIsServedWithoutARestart) {
  const std::string live = File("live");
  auto publish = [&](const std::string& version, const std::string& cert, const std::string& key) {
    Publish("live", version, cert, key);
  };
  publish("v1", "server.pem", "server.key");
  std::vector<std::string> flags = {"--tls_cert_file=" + live + "/cert.pem", "--tls_key_file=" + live + "/key.pem",
                                    "--tls_ca_file=" + File("ca.pem"), "--tls_reload_interval=1s",
                                    "--metrics_listen=127.0.0.1:0"};
  EXPECT_TRUE(testing::RefusesToStart({flags[0], flags[1], "--tls_reload_interval=-1s"}));
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {flags});
  const ClientOptions trusting{.servers = cluster.addresses(), .token = cluster.token(),
                               .timeout = absl::Seconds(10), .tls_ca_file = File("ca.pem")};
  auto client = cluster.Connect(trusting);
  ASSERT_TRUE(client.ok()) << client.status();
  const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token(),
                                            .tls_ca_file = File("ca.pem")});
  ASSERT_TRUE(statuses[0].ok()) << statuses[0].status();
  const std::string control = cluster.addresses()[0];
  const std::string metrics = statuses[0]->metrics_address();
  auto presented = [&](const std::string& address) { return Presented(address); };
  const std::string first = SerialOf("server.pem"), renewed = SerialOf("server2.pem");
  ASSERT_NE(first, renewed);
  EXPECT_EQ(presented(control), first);
  EXPECT_EQ(presented(metrics), first);
  // What status says of it: two days left, a week being the warning's threshold.
  auto expiry = [&] {
    const auto status = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token(),
                                            .tls_ca_file = File("ca.pem")})[0];
    return status.ok() ? absl::FromUnixSeconds(status->tls_expiry_unix_seconds()) : absl::InfinitePast();
  };
  EXPECT_LT(expiry(), absl::Now() + absl::Hours(48));
  std::ostringstream table, err;
  const cli::StatusCommandOptions status_options{
      .servers = cluster.addresses(), .token = cluster.token(), .tls = {.ca_file = File("ca.pem")}};
  EXPECT_EQ(cli::RunStatusCommand(status_options, table, err), 0) << err.str();
  // rank, address, memory, plane, tls, ...
  const std::string row = table.str().substr(table.str().find("\n0 ") + 1);
  const std::vector<std::string> words = absl::StrSplit(row.substr(0, row.find('\n')), ' ', absl::SkipEmpty());
  ASSERT_GE(words.size(), 5u) << table.str();
  EXPECT_EQ(words[1], control);
  EXPECT_EQ(words[4], "47h") << table.str();
  EXPECT_TRUE(absl::StrContains(table.str(), "server 0: its TLS certificate expires 20")) << table.str();

  publish("v2", "server2.pem", "server2.key");
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while ((presented(control) != renewed || presented(metrics) != renewed) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(presented(control), renewed);
  EXPECT_EQ(presented(metrics), renewed);
  EXPECT_GT(expiry(), absl::Now() + absl::Hours(71)) << "server2.pem is valid for three days";
  EXPECT_TRUE((*client)->ConfigureJob({}).ok()) << "the client connected before the renewal";
  EXPECT_TRUE(Client::Connect(trusting).ok()) << "a client connecting after it";

  publish("v3", "server.pem", "server2.key");  // a key that is not the certificate's
  absl::SleepFor(absl::Seconds(3));             // three reload intervals
  EXPECT_EQ(presented(control), renewed);
  EXPECT_EQ(presented(metrics), renewed);
  EXPECT_TRUE(Client::Connect(trusting).ok());
}

// SIGHUP (systemctl reload) reads the TLS files at once: a renewal is served within a
// second or two, not at the next reload interval (an hour here). A plaintext server
// carries on after one, where the signal's default action would have ended it.
TEST_F(TlsTest, SighupTakesRenewedFilesAtOnce) {
  Publish("hup", "hup-v1", "server.pem", "server.key");
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "",
                      {{"--tls_cert_file=" + File("hup/cert.pem"), "--tls_key_file=" + File("hup/key.pem"),
                        "--tls_reload_interval=1h"}});
  ASSERT_TRUE(cluster.Connect({.timeout = absl::Seconds(10), .tls_ca_file = File("ca.pem")}).ok());
  const std::string control = cluster.addresses()[0];
  EXPECT_EQ(Presented(control), SerialOf("server.pem"));
  Publish("hup", "hup-v2", "server2.pem", "server2.key");
  absl::SleepFor(absl::Seconds(2));
  EXPECT_EQ(Presented(control), SerialOf("server.pem")) << "taken before the interval without a SIGHUP";
  cluster.Signal(0, SIGHUP);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (Presented(control) != SerialOf("server2.pem") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(Presented(control), SerialOf("server2.pem"));
  EXPECT_LT(absl::Now(), deadline - absl::Seconds(15)) << "within a few seconds of the signal";

  TestCluster plaintext(1, "tls-token", ::testing::TempDir(), "");
  auto client = plaintext.Connect({.timeout = absl::Seconds(10)});
  ASSERT_TRUE(client.ok()) << client.status();
  plaintext.Signal(0, SIGHUP);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE((*client)->ConfigureJob({}).ok()) << "the server is gone after a SIGHUP";
}

// A CA rotation seen from a client: a CA added to its bundle after it connected is
// trusted when it reconnects (here to a server restarted with a certificate that CA
// signed), without a new client; a client that read its bundle once is refused.
TEST_F(TlsTest, AClientTrustsACaAddedToItsBundleAfterItConnected) {
  Publish("rotating", "rotating-v1", "server.pem", "server.key");
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "",
                      {{"--tls_cert_file=" + File("rotating/cert.pem"), "--tls_key_file=" + File("rotating/key.pem")}});
  std::filesystem::copy_file(File("ca.pem"), File("client-bundle.pem"));
  ClientOptions options{.servers = cluster.addresses(), .token = cluster.token(), .timeout = absl::Seconds(10),
                        .tls_ca_file = File("client-bundle.pem")};
  options.tls_reload_interval = absl::Seconds(1);
  auto reloading = cluster.Connect(options);
  ASSERT_TRUE(reloading.ok()) << reloading.status();
  options.tls_reload_interval = absl::ZeroDuration();
  auto read_once = cluster.Connect(options);
  ASSERT_TRUE(read_once.ok()) << read_once.status();
  ASSERT_TRUE((*reloading)->ConfigureJob({}).ok());

  std::ofstream(File("client-bundle.pem"), std::ios::trunc)
      << ReadFileToString(File("ca.pem")).value_or("") + ReadFileToString(File("other-ca.pem")).value_or("");
  Publish("rotating", "rotating-v2", "other-server.pem", "other-server.key");
  cluster.Restart(0);  // back with the other CA's certificate: the clients reconnect
  absl::Status configured;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(40); absl::Now() < deadline;) {
    if ((configured = (*reloading)->ConfigureJob({})).ok()) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(configured.ok()) << configured;
  const absl::Status refused = (*read_once)->ConfigureJob({});
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
}

// Mutual TLS (--tls_client_ca_file): callers must present a certificate a CA of the
// bundle signed for client use; the servers present theirs in their calls to each other.
TEST_F(TlsTest, WithClientCasOnlyCallersPresentingACertificateOfThemAreServed) {
  std::vector<std::string> flags = ServerTls();
  flags.push_back("--tls_client_ca_file=" + File("ca.pem"));
  std::vector<std::string> read_once = flags;  // server 1: the files read once, not watched
  read_once.push_back("--tls_reload_interval=0");
  std::vector<std::string> logging = flags;  // server 0: every call in its log
  logging.insert(logging.end(), {"--log_level=debug", "--log_file=" + File("mtls-0.log")});
  TestCluster cluster(2, "tls-token", ::testing::TempDir(), "", {logging, read_once});
  const ClientOptions presenting = Presenting(cluster);
  auto client = cluster.Connect(presenting);
  ASSERT_TRUE(client.ok()) << client.status();
  ExpectAClippedStep(**client);

  ClientOptions bare = presenting;
  bare.tls_cert_file = bare.tls_key_file = "";
  absl::StatusOr<std::unique_ptr<Client>> refused = Client::Connect(bare);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "presents no client certificate: a server started with "
                                                            "--tls_client_ca_file needs tls_cert_file"))
      << refused.status();
  ClientOptions other_ca = presenting;
  other_ca.tls_cert_file = File("other-client.pem");
  other_ca.tls_key_file = File("other-client.key");
  refused = Client::Connect(other_ca);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "must trust its CA")) << refused.status();
  ClientOptions half = presenting;
  half.tls_key_file = "";
  EXPECT_TRUE(absl::IsInvalidArgument(Client::Connect(half).status()));
  ClientOptions wrong_key = presenting;
  wrong_key.tls_key_file = File("server.key");
  for (absl::Duration interval : {absl::ZeroDuration(), absl::Minutes(5)}) {  // read once, and kept current
    wrong_key.tls_reload_interval = interval;
    refused = Client::Connect(wrong_key);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status()) &&
                absl::StrContains(refused.status().message(), "tls_key_file=" + File("server.key") +
                                                                  " is not the private key of the certificate"))
        << refused.status();
  }
  ClientOptions plaintext = presenting;
  plaintext.tls_ca_file = "";
  EXPECT_TRUE(absl::IsInvalidArgument(Client::Connect(plaintext).status())) << "a client certificate without TLS";
  ClientOptions server_only = presenting;
  server_only.tls_cert_file = File("server-only.pem");
  server_only.tls_key_file = File("server-only.key");
  for (absl::Duration interval : {absl::ZeroDuration(), absl::Minutes(5)}) {
    server_only.tls_reload_interval = interval;
    refused = Client::Connect(server_only);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status()) &&
                absl::StrContains(refused.status().message(), "lacks clientAuth"))
        << refused.status();
  }

  // The commands present theirs too, and show that the servers ask for one; the cluster
  // serves on after the refusals.
  const std::string table = StatusTable(cluster);
  EXPECT_TRUE(absl::StrContains(table, "h+mtls ")) << table;
  for (const auto& status : FetchClusterStatus(presenting)) {
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(status->tls_client_certificates());
  }
  EXPECT_TRUE((*client)->ConfigureJob({.max_grad_norm = 1.0}).ok());
  // The log names each caller by its certificate (client.pem's common name is "client").
  const std::string log = ReadFileToString(File("mtls-0.log")).value_or("");
  EXPECT_TRUE(absl::StrContains(log, "rpc /flatshard.v1.Flatshard/ConfigureJob from ipv4:127.0.0.1:")) << log;
  EXPECT_TRUE(absl::StrContains(log, " (client): OK in ")) << log;

  // A server whose own certificate its peers would refuse does not start, and says why.
  const auto [code, output] = testing::RunCommand(absl::StrCat(
      "timeout 20 ", FLATSHARD_SERVER_PATH, " --listen=127.0.0.1:1 --tls_cert_file=", File("server-only.pem"),
      " --tls_key_file=", File("server-only.key"), " --tls_client_ca_file=", File("ca.pem"), " 2>&1"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_TRUE(absl::StrContains(output, "unsuitable certificate purpose")) << output;
  EXPECT_TRUE(testing::RefusesToStart({"--tls_cert_file=" + File("server.pem"), "--tls_key_file=" + File("server.key"),
                                       "--tls_client_ca_file=" + File("other-ca.pem")}))
      << "a client bundle that does not sign the servers' certificates";
  EXPECT_TRUE(testing::RefusesToStart({"--tls_client_ca_file=" + File("ca.pem")})) << "without a certificate";
}

// --metrics_client_certificates: scrapes of /metrics present a certificate of the client
// CAs too (and still the token); the flag needs client CAs and metrics to protect.
TEST_F(TlsTest, MetricsClientCertificatesAreAskedOfScrapesToo) {
  std::vector<std::string> flags = ServerTls();
  flags.insert(flags.end(), {"--tls_client_ca_file=" + File("ca.pem"), "--metrics_listen=127.0.0.1:0",
                             "--metrics_client_certificates", "--log_file=" + File("metrics-mtls.log")});
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {flags});
  const auto statuses = FetchClusterStatus(Presenting(cluster));
  ASSERT_TRUE(statuses[0].ok()) << statuses[0].status();
  const std::string address = statuses[0]->metrics_address();
  const std::string port = address.substr(address.rfind(':') + 1);
  const auto [served, metrics] = Scrape(port, File("ca.pem"), cluster.token(), "client");
  EXPECT_EQ(served, 0);
  EXPECT_TRUE(absl::StartsWith(metrics, "HTTP/1.1 200")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "\nflatshard_uptime_seconds ")) << metrics;
  const auto [unauthorized_code, unauthorized] = Scrape(port, File("ca.pem"), "", "client");
  EXPECT_TRUE(absl::StartsWith(unauthorized, "HTTP/1.1 401")) << unauthorized;
  for (const char* identity : {"", "other-client", "server-only"}) {
    const auto [code, answer] = Scrape(port, File("ca.pem"), cluster.token(), identity);
    EXPECT_FALSE(absl::StrContains(answer, "HTTP/1.1")) << "answered a scrape presenting '" << identity << "'";
  }
  const std::string log = ReadFileToString(File("metrics-mtls.log")).value_or("");
  EXPECT_TRUE(absl::StrContains(log, "/metrics (client certificates)")) << log;

  const std::vector<std::string> tls = ServerTls();
  EXPECT_TRUE(
      testing::RefusesToStart({tls[0], tls[1], "--metrics_listen=127.0.0.1:0", "--metrics_client_certificates"}))
      << "without client CAs";
  EXPECT_TRUE(testing::RefusesToStart({tls[0], tls[1], "--tls_client_ca_file=" + File("ca.pem"),
                                       "--metrics_client_certificates"}))
      << "without metrics";
}

// As RefusedBigPayloadTest (faults_test.cc), over a TLS data plane: a server refuses a
// scatter too large to read and drop by answering at once and closing, and the worker,
// its send reset, reads that answer through TLS.
TEST_F(TlsTest, WithTlsDataPlaneARefusalOfAPayloadTooLargeToDrainReachesTheWorker) {
  std::vector<std::string> flags = ServerTls();
  flags.push_back("--tls_data_plane");
  TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {flags});
  ClientOptions options = Presenting(cluster);
  options.job = "big";
  options.timeout = absl::Seconds(60);
  options.scatter_split_bytes = 0;  // one request of the whole 288 MiB shard
  auto client = cluster.Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  constexpr int64_t kNumel = int64_t{72} << 20;
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {kNumel}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  const std::vector<float> grad(kNumel, 1.0f);
  const absl::Status future = (*client)->Scatter("g", 3, DType::kFloat32, AsBytes(grad)).get();
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition) << future;
  EXPECT_THAT(std::string(future.message()), ::testing::HasSubstr("expected step 0")) << future;
  ASSERT_TRUE((*client)->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  EXPECT_EQ(*(*client)->WaitVersion("g", 1), 1);
}

// Pipelines (Client::GatherGroups, ScatterGroups) over a TLS data plane: the server's TLS
// layer reads ahead past the request it serves, and must still see the next ones of the
// pipeline waiting there. 40 small groups (3 pipelines per server) step and gather back
// exactly; an answer held for the next in a pipeline goes out before that one waits.
TEST_F(TlsTest, WithTlsDataPlanePipelinesOfSmallGroupsAreServedWhole) {
  std::vector<std::string> flags = ServerTls();
  flags.push_back("--tls_data_plane");
  TestCluster cluster(2, "tls-token", ::testing::TempDir(), "", {flags, flags});
  ClientOptions options = Presenting(cluster);
  options.job = "pipelines";
  auto client = cluster.Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  std::vector<std::string> names;
  std::vector<GroupSpec> specs;
  for (int g = 0; g < 40; ++g) {
    names.push_back(absl::StrCat("layer", g));
    specs.push_back({names.back(), {{"w", {64 + g}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0}});
  }
  auto layouts = (*client)->RegisterGroups(std::move(specs));
  ASSERT_TRUE(layouts.ok()) << layouts.status();
  std::vector<std::vector<float>> grads(40), params(40);
  std::vector<absl::Span<const std::byte>> sends;
  std::vector<absl::Span<std::byte>> outs;
  for (int g = 0; g < 40; ++g) {
    grads[g].assign((*layouts)[g]->padded_numel(), -static_cast<float>(g));  // SGD lr 1: params become g
    params[g].assign(grads[g].size(), -1.0f);
    sends.push_back(AsBytes(std::as_const(grads[g])));
    outs.push_back(AsBytes(params[g]));
  }
  for (auto& future : (*client)->ScatterGroups(names, 0, DType::kFloat32, sends)) {
    const absl::Status status = future.get();
    ASSERT_TRUE(status.ok()) << status;
  }
  std::vector<std::future<absl::StatusOr<int64_t>>> gathered = (*client)->GatherGroups(names, 1, DType::kFloat32, outs);
  for (int g = 0; g < 40; ++g) {
    const absl::StatusOr<int64_t> version = gathered[g].get();
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(*version, 1);
    const std::vector<float> tensor(params[g].begin(), params[g].begin() + 64 + g);  // the padding aside
    EXPECT_EQ(tensor, std::vector<float>(64 + g, static_cast<float>(g))) << names[g];
  }

  // The server holds its answers to a pipeline back while the next request is read ahead,
  // in the records it read, never across a wait: layer1's gather waits for a version that
  // comes only once this worker, having layer0's parameters, sends layer1's gradient.
  ASSERT_TRUE((*client)->Scatter("layer0", 1, DType::kFloat32, sends[0]).get().ok());  // layer0 at 2
  std::vector<std::future<absl::StatusOr<int64_t>>> held =
      (*client)->GatherGroups({"layer0", "layer1"}, 2, DType::kFloat32, {outs[0], outs[1]});
  ASSERT_EQ(held[0].wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "layer0's answer waited behind layer1's wait";
  EXPECT_EQ(held[0].get().value_or(-1), 2);
  EXPECT_EQ(held[1].wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  ASSERT_TRUE((*client)->Scatter("layer1", 1, DType::kFloat32, sends[1]).get().ok());
  EXPECT_EQ(held[1].get().value_or(-1), 2);
}

// --tls_data_plane (with mutual TLS): a hybrid-sharded step crosses the data plane in TLS,
// from workers (one reading its TLS files once, one keeping them current) to servers and
// between the servers' replica groups (their exchange), to the bits the plain data plane
// gives; the data port then takes no plaintext, and no TLS handshake from a client that
// does not trust its certificate or has no certificate of the client CAs; the status
// says so. The flag needs a certificate.
TEST_F(TlsTest, WithTlsDataPlaneAHybridStepCrossesTheDataPlaneInTls) {
  std::vector<std::string> flags = ServerTls();
  flags.insert(flags.end(), {"--tls_client_ca_file=" + File("ca.pem"), "--tls_data_plane"});
  std::vector<std::string> read_once = flags;
  read_once.push_back("--tls_reload_interval=0");
  flags.push_back("--log_file=" + File("data-tls-0.log"));
  TestCluster cluster(2, "tls-token", ::testing::TempDir(), "", {flags, read_once});
  std::unique_ptr<Client> workers[2];
  for (int w = 0; w < 2; ++w) {
    ClientOptions options = Presenting(cluster);
    options.worker_rank = w;
    options.num_workers = 2;
    options.job = "test";
    options.tls_reload_interval = w == 0 ? absl::ZeroDuration() : absl::Minutes(5);
    auto client = cluster.Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    workers[w] = *std::move(client);
    ASSERT_TRUE(workers[w]->ConfigureJob({.replicas = 2}).ok());
    ASSERT_TRUE(workers[w]->RegisterGroup("g", {{"w", {1 << 20}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  }
  const size_t numel = 1 << 20;  // one replica group of one server each: a whole shard per server
  for (int w = 0; w < 2; ++w) {
    const std::vector<float> grad(numel, w == 0 ? 1.0f : 3.0f);
    ASSERT_TRUE(workers[w]->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  }
  for (int w = 0; w < 2; ++w) {
    std::vector<float> params(numel, 7.0f);
    auto version = workers[w]->Gather("g", 1, DType::kFloat32, AsBytes(params)).get();
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(params, std::vector<float>(numel, -1.0f)) << "worker " << w;  // -0.5 * (1 + 3) / 2
  }
  const auto statuses = FetchClusterStatus(Presenting(cluster));
  for (const auto& status : statuses) {
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_TRUE(status->data_tls());
    EXPECT_GE(status->exchange_bytes_sent(), static_cast<int64_t>(numel * 2)) << "no exchange between the servers";
  }
  const std::string table = StatusTable(cluster);
  EXPECT_TRUE(absl::StrContains(table, "h+mtls+data ")) << table;

  // The data port, directly: a hello (its token made up) in plaintext, or over TLS that
  // does not trust the server, or without a client certificate, gets no answer; with
  // both, the handshake completes and the token is judged.
  const std::string data_address = statuses[0]->data_address();
  auto over = [&](const std::string& ca, const std::string& identity) -> transport::SecureLayer {
    return [=](std::unique_ptr<transport::Connection> tcp, const std::string& host) {
      const std::string chain = identity.empty() ? "" : ReadFileToString(File(identity + ".pem")).value_or("");
      const std::string key = identity.empty() ? "" : ReadFileToString(File(identity + ".key")).value_or("");
      auto context = tls::ClientContext(ReadFileToString(File(ca)).value_or(""), chain, key, "the test");
      if (!context.ok()) return absl::StatusOr<std::unique_ptr<transport::Connection>>(context.status());
      return tls::ClientSide(std::move(tcp), *context, host);
    };
  };
  const std::string made_up(32, 'x');
  const size_t log_before = ReadFileToString(File("data-tls-0.log")).value_or("").size();
  absl::StatusOr<std::unique_ptr<transport::Connection>> opened =
      transport::OpenDataConnection(data_address, made_up, absl::Seconds(10));
  EXPECT_TRUE(absl::IsUnavailable(opened.status())) << opened.status();
  opened = transport::OpenDataConnection(data_address, made_up, absl::Seconds(10), {}, over("other-ca.pem", "client"));
  EXPECT_THAT(std::string(opened.status().message()), ::testing::HasSubstr("certificate verify failed"))
      << opened.status();
  opened = transport::OpenDataConnection(data_address, made_up, absl::Seconds(10), {}, over("ca.pem", ""));
  EXPECT_TRUE(absl::IsUnavailable(opened.status())) << opened.status();
  opened = transport::OpenDataConnection(data_address, made_up, absl::Seconds(10), {}, over("ca.pem", "client"));
  EXPECT_TRUE(absl::IsUnauthenticated(opened.status())) << opened.status();
  EXPECT_THAT(std::string(opened.status().message()), ::testing::HasSubstr("invalid data-plane session token"));
  // The server's log says why it refused the handshakes (not a plaintext hello, which
  // is garbage to it as any stray bytes are).
  const std::string log = ReadFileToString(File("data-tls-0.log")).value_or("").substr(log_before);
  EXPECT_THAT(log, ::testing::HasSubstr("data plane: UNAUTHENTICATED: TLS handshake with 127.0.0.1:")) << log;
  EXPECT_THAT(log, ::testing::HasSubstr("peer did not return a certificate")) << log;

  EXPECT_TRUE(testing::RefusesToStart({"--tls_data_plane"})) << "without a certificate";
}

// --tls_data_plane with a --memory=device server: GPU workers' CUDA IPC and NCCL requests,
// and their answers, cross the TLS data connection (a gather waiting there for its
// version, NCCL's early-answer polls), while the bytes move GPU to GPU outside it; the
// values are those a host gather over TLS sees. Skipped without a GPU.
TEST_F(TlsTest, WithTlsDataPlaneGpuWorkersTransferOverCudaIpcAndNccl) {
  if (!testing::HaveGpu()) GTEST_SKIP() << "GPU workers need a CUDA build and a CUDA device";
  for (const DevicePlane plane : {DevicePlane::kCudaIpc, DevicePlane::kNccl}) {
    if (plane == DevicePlane::kNccl && !testing::HaveNccl()) continue;  // said below
    const bool nccl = plane == DevicePlane::kNccl;
    SCOPED_TRACE(nccl ? "NCCL" : "CUDA IPC");
    std::vector<std::string> flags = ServerTls();
    flags.insert(flags.end(), {"--memory=device", "--tls_data_plane"});
    if (nccl) testing::SetNcclHost(testing::kNcclServers);
    TestCluster cluster(1, "tls-token", ::testing::TempDir(), "", {flags});
    if (nccl) testing::SetNcclHost(testing::kNcclWorkers);
    auto client = cluster.Connect({.worker_rank = 0,
                                   .num_workers = 1,
                                   .job = "test",
                                   .timeout = absl::Seconds(20),
                                   .device_plane = plane,
                                   .tls_ca_file = File("ca.pem")});
    ASSERT_TRUE(client.ok()) << client.status();
    Client& c = **client;
    ASSERT_TRUE(c.ConfigureJob({}).ok());
    auto layout = c.RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
    ASSERT_TRUE(layout.ok()) << layout.status();
    ASSERT_TRUE(c.InitGroupFromSeed("g", 3).ok());
    const int64_t numel = (*layout)->padded_numel();
    std::vector<float> before(numel), after(numel), landed(numel);
    ASSERT_EQ(c.Gather("g", 0, DType::kFloat32, AsBytes(before)).get().value_or(-1), 0);  // host, over TLS
    testing::DeviceBytes params(numel * 4), next(numel * 4), grad(numel * 4);
    ASSERT_EQ(c.Gather("g", 0, DType::kFloat32, params.span()).get().value_or(-1), 0);
    EXPECT_EQ(c.DataPlanes(), std::vector<std::string>{nccl ? "nccl" : "cuda-ipc"});
    params.Download(AsBytes(landed));
    EXPECT_EQ(landed, before);
    auto waiting = c.Gather("g", 1, DType::kFloat32, next.span());  // waits on the server for the step
    grad.Upload(AsBytes(std::vector<float>(numel, 1.0f)));
    ASSERT_TRUE(c.Scatter("g", 0, DType::kFloat32, grad.span()).get().ok());
    ASSERT_EQ(waiting.get().value_or(-1), 1);
    ASSERT_EQ(c.Gather("g", 1, DType::kFloat32, AsBytes(after)).get().value_or(-1), 1);
    next.Download(AsBytes(landed));
    EXPECT_EQ(landed, after);
    for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(after[i], before[i] - 0.5f) << i;
  }
  if (!testing::HaveNccl()) GTEST_SKIP() << "CUDA IPC checked; NCCL does not load here (set FLATSHARD_NCCL_LIBRARY)";
}

TEST_F(TlsTest, MismatchedTlsFilesStopTheServerAtStartUp) {
  const std::string cert = "--tls_cert_file=" + File("server.pem");
  EXPECT_TRUE(testing::RefusesToStart({cert})) << "a certificate without its key";
  EXPECT_TRUE(testing::RefusesToStart({cert, "--tls_key_file=" + File("ca.key")})) << "another key";
  EXPECT_TRUE(testing::RefusesToStart({cert, "--tls_key_file=" + File("server.pem")})) << "no key";
  EXPECT_TRUE(testing::RefusesToStart({cert, "--tls_key_file=" + File("server.key"),
                                       "--tls_ca_file=" + File("server.csr")}))
      << "a CA file without a certificate";
  EXPECT_TRUE(testing::RefusesToStart({"--tls_ca_file=" + File("ca.pem")})) << "a CA without a certificate";
  const std::string other = ReadFileToString(File("other-ca.pem")).value_or("");
  std::ofstream(File("cut-ca.pem")) << ReadFileToString(File("ca.pem")).value_or("") + other.substr(0, other.size() / 2);
  EXPECT_TRUE(testing::RefusesToStart({cert, "--tls_key_file=" + File("server.key"),
                                       "--tls_ca_file=" + File("cut-ca.pem")}))
      << "a CA file cut short";
  EXPECT_TRUE(testing::RefusesToStart({cert, "--tls_key_file=" + File("missing.key")})) << "a missing file";
  EXPECT_TRUE(testing::RefusesToStart(
      {"--tls_cert_file=" + File("expired.pem"), "--tls_key_file=" + File("expired.key")}))
      << "an expired certificate";
  EXPECT_FALSE(testing::RefusesToStart(ServerTls())) << "matching files must start";
}

}  // namespace
}  // namespace flatshard
