// Servers check at start-up that they agree on the cluster and report it in their status.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "flatshard/client.h"
#include "proto/cluster_info.h"
#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/health_check.h"
#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using testing::HealthCheck;

// Polls the status of `cluster`'s server `rank` until its cluster check leaves
// "checking" (10 s at most).
std::string ClusterCheck(const testing::TestCluster& cluster, int rank) {
  auto stub = v1::Flatshard::NewStub(
      grpc::CreateChannel(cluster.addresses()[rank], grpc::InsecureChannelCredentials()));
  for (int attempt = 0; attempt < 100; ++attempt) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + cluster.token());
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    v1::ServerStatus status;
    if (stub->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok() &&
        status.cluster_check() != "checking") {
      return status.cluster_check();
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return "timeout";
}

// Kubernetes' grpc probe (and grpc_health_probe) ask without a token; the rest of the
// control plane still wants one.
TEST(HealthCheckTest, ServersAnswerTheStandardHealthCheckWithoutAToken) {
  const testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  for (const std::string service : {"", "flatshard.v1.Flatshard"}) {
    const auto [status, serving] = HealthCheck(cluster.addresses()[0], service);
    ASSERT_TRUE(status.ok()) << "'" << service << "': " << status.error_message();
    EXPECT_EQ(serving, testing::kServing) << "'" << service << "'";
  }
  const auto [unknown, _] = HealthCheck(cluster.addresses()[0], "no.such.Service");
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();

  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ServerStatus server_status;
  EXPECT_EQ(stub->GetStatus(&ctx, v1::GetStatusRequest(), &server_status).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST(ClusterCheckTest, AgreeingServersSayAgreed) {
  const testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  EXPECT_EQ(ClusterCheck(cluster, 0), "agreed");
  EXPECT_EQ(ClusterCheck(cluster, 1), "agreed");
}

TEST(ClusterCheckTest, DisagreementIsReportedWithTheDifference) {
  // Server 1 believes in a third server, on a port nobody listens on.
  const std::string third = "127.0.0.1:1";
  const testing::TestCluster cluster(2, "tok", ::testing::TempDir(), "",
                                     {{}, {"--cluster={cluster}," + third}});
  const std::string a = cluster.addresses()[0], b = cluster.addresses()[1];
  EXPECT_THAT(ClusterCheck(cluster, 0),
              HasSubstr("mismatch: server " + b + " is rank 1 of cluster [" + a + "," + b + "," + third + "]"));
  EXPECT_THAT(ClusterCheck(cluster, 1), HasSubstr("mismatch"));
}

// A server of another release, as far as a client's first call goes: it answers
// GetClusterInfo with another protocol revision (and no other call).
class OtherReleaseServer final : public v1::Flatshard::Service {
 public:
  OtherReleaseServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~OtherReleaseServer() override { server_->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  grpc::Status GetClusterInfo(grpc::ServerContext*, const v1::GetClusterInfoRequest*, v1::ClusterInfo* info) override {
    info->set_rank(0);
    info->add_cluster(address());
    info->set_protocol(kProtocolRevision + 1);
    info->set_version("99.0.0");
    return grpc::Status::OK;
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST(ClusterCheckTest, AClientRefusesAServerOfAnotherProtocolRevision) {
  OtherReleaseServer server;
  auto client = Client::Connect({.servers = {server.address()}, .timeout = absl::Seconds(10)});
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition) << client.status();
  EXPECT_THAT(
      client.status().message(),
      HasSubstr(absl::StrCat("server ", server.address(), " speaks flatshard protocol revision ", kProtocolRevision + 1,
                             " (flatshard 99.0.0); this client speaks revision ", kProtocolRevision)));
}

}  // namespace
}  // namespace flatshard
