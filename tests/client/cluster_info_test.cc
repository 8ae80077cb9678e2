// CheckClusterInfo: what clients and peer servers accept of a server's GetClusterInfo.
#include "proto/cluster_info.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace flatshard {
namespace {

using ::testing::HasSubstr;

const std::vector<std::string> kCluster = {"127.0.0.1:7001", "127.0.0.1:7002"};

// What server `rank` of `cluster` at `protocol` answers.
v1::ClusterInfo Info(const std::vector<std::string>& cluster, int rank, uint32_t protocol = kProtocolRevision) {
  v1::ClusterInfo info;
  info.set_rank(rank);
  for (const std::string& address : cluster) info.add_cluster(address);
  info.set_protocol(protocol);
  info.set_version("9.9.9");
  return info;
}

TEST(ClusterInfoTest, AServerOfTheClusterAtItsRankAndRevisionPasses) {
  EXPECT_TRUE(CheckClusterInfo(Info(kCluster, 1), kCluster, 1, "this client").ok());
}

TEST(ClusterInfoTest, AnotherRankOrClusterIsRefusedNamingBoth) {
  const absl::Status rank = CheckClusterInfo(Info(kCluster, 0), kCluster, 1, "this client");
  EXPECT_TRUE(absl::IsFailedPrecondition(rank)) << rank;
  EXPECT_THAT(rank.message(), HasSubstr("server 127.0.0.1:7002 is rank 0 of cluster [127.0.0.1:7001,127.0.0.1:7002]; "
                                        "this client expects rank 1 of [127.0.0.1:7001,127.0.0.1:7002]"));
  const absl::Status cluster = CheckClusterInfo(Info({"127.0.0.1:7001"}, 0), kCluster, 0, "this server (rank 1)");
  EXPECT_TRUE(absl::IsFailedPrecondition(cluster)) << cluster;
  EXPECT_THAT(cluster.message(), HasSubstr("this server (rank 1) expects rank 0 of"));
}

// A server of another release is refused before anything else it says is read: an older
// one leaves the revision out.
TEST(ClusterInfoTest, AnotherProtocolRevisionIsRefusedNamingBothReleases) {
  const absl::Status newer = CheckClusterInfo(Info(kCluster, 0, kProtocolRevision + 1), kCluster, 0, "this client");
  EXPECT_TRUE(absl::IsFailedPrecondition(newer)) << newer;
  EXPECT_THAT(newer.message(),
              HasSubstr(absl::StrCat("server 127.0.0.1:7001 speaks flatshard protocol revision ", kProtocolRevision + 1,
                                     " (flatshard 9.9.9); this client speaks revision ", kProtocolRevision,
                                     " (flatshard ", FlatshardVersion(), "): run clients and servers of one release")));
  v1::ClusterInfo older = Info({"elsewhere:1"}, 5);
  older.clear_protocol();
  older.clear_version();
  const absl::Status refused = CheckClusterInfo(older, kCluster, 0, "this server (rank 1)");
  EXPECT_THAT(refused.message(), HasSubstr("speaks flatshard protocol revision 0 (flatshard of unknown version); "
                                           "this server (rank 1) speaks revision"));
}

}  // namespace
}  // namespace flatshard
