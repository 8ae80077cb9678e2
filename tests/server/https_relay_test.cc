// HttpsRelay (server/https_relay.h) in front of a fake HTTP endpoint, with a client that
// checks the certificate (openssl s_client): the request reaches the endpoint as it was
// sent, and the endpoint's answer, however long, comes back intact; past kMaxConnections
// a connection is closed at once while the others are held, and once they go the relay
// serves again. The relay with a whole server around it: TlsTest in
// tests/integration/tls_test.cc.
#include "server/https_relay.h"

#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/run_command.h"
#include "tests/scratch_dir.h"
#include "tests/test_certificates.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::server {
namespace {

std::string ReadFile(const std::string& path) { return ReadFileToString(path).value_or(""); }

// Accepts connections on 127.0.0.1 one at a time; reads each request until its client
// closes its sending side, keeps it, answers `answer` and closes.
class FakeEndpoint {
 public:
  explicit FakeEndpoint(std::string answer) : answer_(std::move(answer)) {
    auto listener = transport::ListenTcp("127.0.0.1", 0);
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = *std::move(listener);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeEndpoint() {
    listener_->Shutdown();
    thread_.join();
  }
  int port() const { return listener_->port(); }
  std::vector<std::string> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  void Serve() {
    for (;;) {
      absl::StatusOr<std::unique_ptr<transport::Connection>> conn = listener_->Accept();
      if (!conn.ok()) return;
      if (!(*conn)->SetTimeout(absl::Seconds(10)).ok()) continue;
      std::string request;
      for (std::byte byte; (*conn)->Recv(absl::MakeSpan(&byte, 1)).ok();) request.push_back(static_cast<char>(byte));
      {
        absl::MutexLock lock(&mu_);
        requests_.push_back(request);
      }
      (void)(*conn)->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(answer_.data()), answer_.size())});
    }
  }

  const std::string answer_;
  std::unique_ptr<transport::Listener> listener_;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<std::string> requests_ ABSL_GUARDED_BY(mu_);
};

class HttpsRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::MakeTestCertificates(dir_.path())) << "openssl could not make the test certificates";
    tls_ = {.cert_chain = ReadFile(File("server.pem")), .private_key = ReadFile(File("server.key")), .root_certs = ""};
  }

  std::string File(const std::string& name) const { return absl::StrCat(dir_.path(), "/", name); }

  // What `openssl s_client`, trusting ca.pem and checking that the certificate names
  // 127.0.0.1, gets for `request` at 127.0.0.1:`port`, presenting the client certificate
  // `identity`.pem (empty: none); its exit code and the answer.
  std::pair<int, std::string> Fetch(int port, const std::string& request, const std::string& identity = "") const {
    std::ofstream(File("request")) << request;
    const std::string presented =
        identity.empty()
            ? ""
            : absl::StrCat(" -cert '", File(identity + ".pem"), "' -key '", File(identity + ".key"), "'");
    return testing::RunCommand(absl::StrCat("timeout 20 openssl s_client -quiet -connect 127.0.0.1:", port,
                                            " -CAfile '", File("ca.pem"), "' -verify_return_error ",
                                            "-verify_ip 127.0.0.1", presented, " < '", File("request"),
                                            "' 2>/dev/null"));
  }

  const testing::ScratchDir dir_{"https-relay"};
  TlsOptions tls_;
};

TEST_F(HttpsRelayTest, TheRequestAndALongAnswerCrossIntact) {
  std::mt19937 rng(7);
  std::string answer = "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n";
  for (int i = 0; i < (1 << 20); ++i) answer.push_back(static_cast<char>('a' + rng() % 26));
  FakeEndpoint endpoint(answer);
  auto relay = HttpsRelay::Start("127.0.0.1", 0, tls_, nullptr, endpoint.port());
  ASSERT_TRUE(relay.ok()) << relay.status();
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic cDp0b2s=\r\n\r\n";
  const auto [exit_code, got] = Fetch((*relay)->port(), request);
  EXPECT_EQ(exit_code, 0);
  EXPECT_EQ(got.size(), answer.size());
  EXPECT_TRUE(got == answer) << "the answer changed on its way";
  EXPECT_EQ(endpoint.requests(), std::vector<std::string>{request});
}

TEST_F(HttpsRelayTest, ConnectionsPastTheLimitAreClosedAndTheRelayServesOnceOthersGo) {
  FakeEndpoint endpoint("HTTP/1.1 200 OK\r\n\r\nok");
  auto relay = HttpsRelay::Start("127.0.0.1", 0, tls_, nullptr, endpoint.port());
  ASSERT_TRUE(relay.ok()) << relay.status();
  const int port = (*relay)->port();
  std::vector<std::unique_ptr<transport::Connection>> silent;  // held in their handshakes
  for (int i = 0; i < HttpsRelay::kMaxConnections; ++i) {
    auto conn = transport::ConnectTcp("127.0.0.1", port, absl::Seconds(5));
    ASSERT_TRUE(conn.ok()) << conn.status();
    silent.push_back(*std::move(conn));
  }
  const absl::Time start = absl::Now();
  const auto [refused, nothing] = Fetch(port, "GET / HTTP/1.0\r\n\r\n");
  EXPECT_NE(refused, 0);
  EXPECT_EQ(nothing, "");
  EXPECT_LT(absl::Now() - start, HttpsRelay::kIoTimeout) << "the connection past the limit waited";
  EXPECT_TRUE(endpoint.requests().empty());
  silent.clear();
  std::pair<int, std::string> served;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(10); absl::Now() < deadline;) {
    served = Fetch(port, "GET / HTTP/1.0\r\n\r\n");
    if (served.first == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(served.first, 0);
  EXPECT_EQ(served.second, "HTTP/1.1 200 OK\r\n\r\nok");
}

// With metrics_client_certificates, only a client presenting a certificate of the client
// CAs for client use gets through to the endpoint: not one without a certificate, one of
// another CA, or one for serverAuth only. A bundle with no certificate is refused.
TEST_F(HttpsRelayTest, WithClientCertificatesOnlyClientsOfTheClientCasReachTheEndpoint) {
  FakeEndpoint endpoint("HTTP/1.1 200 OK\r\n\r\nok");
  TlsOptions mutual = tls_;
  mutual.client_root_certs = ReadFile(File("ca.pem"));
  mutual.metrics_client_certificates = true;
  auto relay = HttpsRelay::Start("127.0.0.1", 0, mutual, nullptr, endpoint.port());
  ASSERT_TRUE(relay.ok()) << relay.status();
  const std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
  for (const char* refused : {"", "other-client", "server-only"}) {
    const auto [code, answer] = Fetch((*relay)->port(), request, refused);
    EXPECT_EQ(answer, "") << "served presenting '" << refused << "'";
  }
  EXPECT_TRUE(endpoint.requests().empty());
  const auto [served, answer] = Fetch((*relay)->port(), request, "client");
  EXPECT_EQ(served, 0);
  EXPECT_EQ(answer, "HTTP/1.1 200 OK\r\n\r\nok");
  EXPECT_EQ(endpoint.requests(), std::vector<std::string>{request});

  mutual.client_root_certs = "not a certificate";
  EXPECT_EQ(HttpsRelay::Start("127.0.0.1", 0, mutual, nullptr, endpoint.port()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(HttpsRelayTest, AKeyThatIsNotTheCertificatesIsRefused) {
  const TlsOptions mismatched{.cert_chain = tls_.cert_chain, .private_key = ReadFile(File("ca.key")), .root_certs = ""};
  auto relay = HttpsRelay::Start("127.0.0.1", 0, mismatched, nullptr, 1);
  EXPECT_EQ(relay.status().code(), absl::StatusCode::kInvalidArgument) << relay.status();
}

}  // namespace
}  // namespace flatshard::server
