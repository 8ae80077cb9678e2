// `flatshard status` (client/cli/status_command.h) against real servers: the table and
// the JSON describe every server (memory, plane, TLS, kernel threads, groups), and a
// server that does not answer makes it fail while the others are still listed.
#include "client/cli/status_command.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

TEST(StatusCommandTest, TableAndJsonDescribeEveryServerAndAnUnreachableOneFails) {
  testing::TestCluster cluster(2, "status-token", ::testing::TempDir(), "",
                               {{"--compute_threads=3"}, {"--compute_threads=3"}});
  auto client = cluster.Connect(0, 1, "status");
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{}).ok());

  cli::StatusCommandOptions options{.servers = cluster.addresses(), .token = cluster.token()};
  std::ostringstream table, err;
  ASSERT_EQ(cli::RunStatusCommand(options, table, err), 0) << err.str();
  for (int rank = 0; rank < 2; ++rank) {
    // rank, address, memory, plane, tls, threads, groups
    const std::regex row(absl::StrCat("\n", rank, " +", cluster.addresses()[rank], " +host +tcp +no +3 +1 "));
    EXPECT_TRUE(std::regex_search(table.str(), row)) << table.str();
    const std::regex group(absl::StrCat("\n", rank, " +status/g +0 +500 "));  // version 0, 500 of 1000
    EXPECT_TRUE(std::regex_search(table.str(), group)) << table.str();
  }

  options.json = true;
  std::ostringstream json;
  ASSERT_EQ(cli::RunStatusCommand(options, json, err), 0) << err.str();
  const nlohmann::json parsed = nlohmann::json::parse(json.str());
  ASSERT_EQ(parsed["servers"].size(), 2u);
  for (const auto& server : parsed["servers"]) {
    EXPECT_EQ(server["compute_threads"], 3);
    EXPECT_EQ(server["tls"], false);
    EXPECT_EQ(server["memory"], "host");
    EXPECT_EQ(server["groups"].size(), 1u);
  }

  const std::vector<int> free_port = *transport::PickFreeLoopbackPorts(1);
  options = {.servers = {cluster.addresses()[0], absl::StrCat("127.0.0.1:", free_port[0])},
             .token = cluster.token(), .timeout = absl::Seconds(2)};
  std::ostringstream partial, partial_err;
  EXPECT_EQ(cli::RunStatusCommand(options, partial, partial_err), 1);
  EXPECT_TRUE(std::regex_search(partial.str(), std::regex("\n0 +127\\.0\\.0\\.1:[0-9]+ +host "))) << partial.str();
  EXPECT_NE(partial.str().find("unreachable"), std::string::npos) << partial.str();
  EXPECT_NE(partial_err.str().find("some servers did not answer"), std::string::npos);
}

}  // namespace
}  // namespace flatshard
