// Servers check at start-up that they agree on the cluster and report it in their status.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

// Polls `address`'s status until its cluster check leaves "checking" (10 s at most).
std::string ClusterCheck(const std::string& address) {
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  for (int attempt = 0; attempt < 100; ++attempt) {
    grpc::ClientContext ctx;
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
  const std::vector<int> ports = *transport::PickFreeLoopbackPorts(4);
  const std::string a = absl::StrCat("127.0.0.1:", ports[0]);
  const std::string b = absl::StrCat("127.0.0.1:", ports[2]);
  const pid_t pa = testing::SpawnServer({"--listen=" + a, "--rank=0", "--cluster=" + a + "," + b,
                                         absl::StrCat("--data_listen=127.0.0.1:", ports[1])});
  const pid_t pb = testing::SpawnServer({"--listen=" + b, "--rank=1", "--cluster=" + a + "," + b,
                                         absl::StrCat("--data_listen=127.0.0.1:", ports[3])});
  EXPECT_EQ(ClusterCheck(a), "agreed");
  EXPECT_EQ(ClusterCheck(b), "agreed");
  testing::StopServer(pa);
  testing::StopServer(pb);
}

TEST(ClusterCheckTest, DisagreementIsReportedWithTheDifference) {
  const std::vector<int> ports = *transport::PickFreeLoopbackPorts(5);
  const std::string a = absl::StrCat("127.0.0.1:", ports[0]);
  const std::string b = absl::StrCat("127.0.0.1:", ports[2]);
  const std::string c = absl::StrCat("127.0.0.1:", ports[4]);  // nobody listens there
  const pid_t pa = testing::SpawnServer({"--listen=" + a, "--rank=0", "--cluster=" + a + "," + b,
                                         absl::StrCat("--data_listen=127.0.0.1:", ports[1])});
  const pid_t pb = testing::SpawnServer({"--listen=" + b, "--rank=1",
                                         "--cluster=" + a + "," + b + "," + c,
                                         absl::StrCat("--data_listen=127.0.0.1:", ports[3])});
  const std::string check = ClusterCheck(a);
  EXPECT_THAT(check, HasSubstr("mismatch: server " + b + " is rank 1 of [" + a + "," + b + "," + c + "]"));
  EXPECT_THAT(ClusterCheck(b), HasSubstr("mismatch"));
  testing::StopServer(pa);
  testing::StopServer(pb);
}

}  // namespace
}  // namespace flatshard
