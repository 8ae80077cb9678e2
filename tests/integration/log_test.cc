// The server's log (server/log.h) as an operator reads it: --log_file gets one line per
// event with the rank and level, --log_level filters them, the refusals an operator should
// see are warnings at any level (a burst of each kind per period), and a bad level or file
// stops the server at start-up.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cluster_status.h"
#include "proto/flatshard.grpc.pb.h"
#include "server/log_throttle.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Calls GetStatus on `address` `times` times with a wrong token (each refused).
void RefuseGetStatus(const std::string& address, int times) {
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < times; ++i) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer not-the-token");
    v1::ServerStatus status;
    ASSERT_EQ(stub->GetStatus(&context, v1::GetStatusRequest(), &status).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
}

// Configures job "log", registers a group (once well, once with an empty name: refused
// with INVALID_ARGUMENT), saves and loads it and deletes the job, on a one-server cluster
// logging at `level` into `file`; returns the log once the server has stopped.
std::string RunAndLog(const std::string& level, const std::string& file, const std::string& root) {
  std::filesystem::create_directories(root);
  {
    testing::TestCluster cluster(1, "log-token", ::testing::TempDir(), root,
                                 {{"--log_level=" + level, "--log_file=" + file}});
    auto client = cluster.Connect(0, 1, "log");
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return "";
    EXPECT_TRUE((*client)->ConfigureJob({}).ok());
    EXPECT_TRUE((*client)->RegisterGroup("g", {{"w", {100}, DType::kFloat32}}, 0, SgdOptions{}).ok());
    EXPECT_EQ((*client)->RegisterGroup("", {{"w", {100}, DType::kFloat32}}, 0, SgdOptions{}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE((*client)->InitGroupFromSeed("g", 1).ok());
    EXPECT_TRUE((*client)->SaveCheckpoint("c", CheckpointKind::kSharded, false).ok());
    EXPECT_TRUE((*client)->LoadCheckpoint("c").ok());
    EXPECT_TRUE((*client)->DeleteJob().ok());
  }  // the server stops
  return ReadAll(file);
}

TEST(LogTest, EventsGoToTheLogFileAtTheirLevels) {
  const testing::ScratchDir scratch("server-log");
  const std::string info = RunAndLog("info", scratch.path() + "/info.log", scratch.path());
  EXPECT_THAT(info, HasSubstr(" rank 0 info: serving as rank 0 of 1: control 127.0.0.1:"));
  EXPECT_THAT(info, HasSubstr(" rank 0 info: job 'log' configured: workers 1, sync, reduce mean"));
  EXPECT_THAT(info, HasSubstr(" rank 0 info: group 'log/g' registered: tensors 1, elements 100; here shard 0 of 1"));
  EXPECT_THAT(info, HasSubstr(" rank 0 warning: rpc /flatshard.v1.Flatshard/RegisterGroup from ipv4:127.0.0.1:"));
  EXPECT_THAT(info, HasSubstr(": INVALID_ARGUMENT in "));
  EXPECT_THAT(info, HasSubstr(" rank 0 info: checkpoint 'c' committed: " +
                              std::filesystem::canonical(scratch.path()).string() + "/c (sharded of job 'log')"));
  EXPECT_THAT(info, HasSubstr(" rank 0 info: checkpoint 'c' loaded into job 'log' as load "));
  EXPECT_THAT(info, HasSubstr(" rank 0 info: job 'log' deleted: groups 1, bytes freed "));
  EXPECT_THAT(info, HasSubstr(" rank 0 info: stopped\n"));
  EXPECT_THAT(info, Not(HasSubstr(" debug: ")));

  // Debug adds every call; warning keeps the refusal alone.
  const std::string debug = RunAndLog("debug", scratch.path() + "/debug.log", scratch.path() + "/debug-root");
  EXPECT_THAT(debug, HasSubstr(" rank 0 debug: rpc /flatshard.v1.Flatshard/ConfigureJob from ipv4:127.0.0.1:"));
  EXPECT_THAT(debug, HasSubstr(" rank 0 info: job 'log' configured"));
  const std::string warning = RunAndLog("warning", scratch.path() + "/warning.log", scratch.path() + "/warning-root");
  EXPECT_THAT(warning, HasSubstr(" rank 0 warning: rpc /flatshard.v1.Flatshard/RegisterGroup"));
  EXPECT_THAT(warning, Not(HasSubstr(" info: ")));
}

TEST(LogTest, ABadLevelOrFileStopsTheServer) {
  EXPECT_TRUE(testing::RefusesToStart({"--log_level=verbose"}));
  // A log file under a regular file cannot be made (missing directories are created).
  const testing::ScratchDir scratch("server-log-file");
  std::ofstream(scratch.path() + "/plain") << "not a directory\n";
  EXPECT_TRUE(testing::RefusesToStart({"--log_file=" + scratch.path() + "/plain/server.log"}));
}

// Calls refused for a wrong token, over and over (a fleet of workers given the wrong one),
// and data connections refused at their hello: each kind logs a burst of warnings per
// period and holds the rest back, rather than a line per refusal.
TEST(LogTest, AFloodOfRefusalsLogsABurstOfEachKind) {
  const testing::ScratchDir scratch("server-log-flood");
  const std::string file = scratch.path() + "/flood.log";
  constexpr int kRefusals = 3 * server::LogThrottle::kBurst;
  {
    testing::TestCluster cluster(1, "log-token", ::testing::TempDir(), "", {{"--log_file=" + file}});
    ASSERT_NO_FATAL_FAILURE(RefuseGetStatus(cluster.addresses()[0], kRefusals));
    for (int i = 0; i < kRefusals; ++i) {
      auto conn = cluster.RawDataConnection(0, /*hello=*/true, "not-a-session-token");
      ASSERT_TRUE(conn.ok()) << conn.status();
      std::byte byte;
      EXPECT_FALSE((*conn)->Recv(absl::MakeSpan(&byte, 1)).ok()) << "the server closes it";
    }
    // The status counts every refused call, by method and code.
    const absl::StatusOr<v1::ServerStatus> status =
        FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})[0];
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->rpc_errors_size(), 1) << status->DebugString();
    EXPECT_EQ(status->rpc_errors(0).method(), "flatshard.v1.Flatshard/GetStatus");
    EXPECT_EQ(status->rpc_errors(0).code(), "UNAUTHENTICATED");
    EXPECT_EQ(status->rpc_errors(0).count(), kRefusals);
    EXPECT_EQ(status->errors(), kRefusals) << "the data plane's refused hellos";
  }  // the server stops
  const std::string log = ReadAll(file);
  auto lines_with = [&](const std::string& text) {
    int lines = 0;
    for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++lines;
    return lines;
  };
  EXPECT_EQ(lines_with("warning: rpc /flatshard.v1.Flatshard/GetStatus from ipv4:127.0.0.1:"),
            server::LogThrottle::kBurst)
      << log;
  EXPECT_EQ(lines_with("warning: data plane: UNAUTHENTICATED"), server::LogThrottle::kBurst) << log;
  // No refusal came after the flood: the server says what it held back when it stops.
  const int held_back = kRefusals - server::LogThrottle::kBurst;
  EXPECT_EQ(lines_with(absl::StrCat("warning: held back: ", held_back, " more warnings of 'rpc "
                                    "/flatshard.v1.Flatshard/GetStatus UNAUTHENTICATED' after the last one logged")),
            1)
      << log;
  EXPECT_EQ(lines_with(absl::StrCat("warning: held back: ", held_back, " more warnings of 'connection UNAUTHENTICATED'")),
            1)
      << log;
  EXPECT_EQ(lines_with("held back:"), 2) << log;
}

// A flood that stops while the server goes on serving is summed up by the server's own
// thread once the kind's period is over (within two periods of the flood), not only at
// shutdown, and only once.
TEST(LogTest, AFloodThatStopsIsSummedUpWhileTheServerServes) {
  const testing::ScratchDir scratch("server-log-summary");
  const std::string file = scratch.path() + "/summary.log";
  constexpr int kRefusals = 2 * server::LogThrottle::kBurst;
  const std::string summary = absl::StrCat("warning: held back: ", kRefusals - server::LogThrottle::kBurst,
                                           " more warnings of 'rpc /flatshard.v1.Flatshard/GetStatus UNAUTHENTICATED'"
                                           " after the last one logged");
  {
    testing::TestCluster cluster(1, "log-token", ::testing::TempDir(), "", {{"--log_file=" + file}});
    ASSERT_NO_FATAL_FAILURE(RefuseGetStatus(cluster.addresses()[0], kRefusals));
    const absl::Time deadline = absl::Now() + 2 * server::LogThrottle::kPeriod + absl::Seconds(5);
    while (ReadAll(file).find(summary) == std::string::npos && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(200));
    }
    EXPECT_THAT(ReadAll(file), HasSubstr(summary)) << "not said while the server serves";
  }  // the server stops: nothing more is held back
  const std::string log = ReadAll(file);
  size_t lines = 0;
  for (size_t at = log.find("held back:"); at != std::string::npos; at = log.find("held back:", at + 1)) ++lines;
  EXPECT_EQ(lines, 1u) << log;
}

}  // namespace
}  // namespace flatshard
