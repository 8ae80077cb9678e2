// Servers check at start-up that they agree on the cluster and report it in their status.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

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

}  // namespace
}  // namespace flatshard
