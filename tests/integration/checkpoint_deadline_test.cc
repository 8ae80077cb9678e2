// How long calls whose work grows with the model may take: registering a group
// allocates its memory, a save, load or export moves all of it, so the client's per-call
// timeout bounds only a checkpoint's wait for its cut, ClientOptions::model_timeout the
// whole call, and keepalive pings a server that hangs meanwhile (proto/keepalive.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <string>

#include "absl/time/clock.h"
#include "client/cluster_status.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

// 64 Mi float32 elements with Adam: 768 MiB to save with the optimizer state, the same
// to load and to export, on 2 servers.
constexpr int64_t kNumel = int64_t{64} << 20;

// A client of job "test" with `options` (servers and token filled in), connecting again
// while a loaded machine makes its short timeout run out during the handshake.
absl::StatusOr<std::unique_ptr<Client>> ConnectWith(const testing::TestCluster& cluster, ClientOptions options) {
  options.job = "test";
  absl::StatusOr<std::unique_ptr<Client>> client;
  for (int attempt = 0; attempt < 20; ++attempt) {
    client = cluster.Connect(options);
    if (client.ok() || !absl::IsDeadlineExceeded(client.status())) return client;
  }
  return client;
}

void RegisterBigGroup(Client& client) {
  ASSERT_TRUE(client.ConfigureJob({}).ok());
  ASSERT_TRUE(client.RegisterGroup("g", {{"w", {kNumel}, DType::kFloat32}}, 0, AdamOptions{}).ok());
  ASSERT_TRUE(client.InitGroupFromSeed("g", 7).ok());
}

TEST(CheckpointDeadlineTest, CallsThatGrowWithTheModelOutlastThePerCallTimeout) {
  const testing::ScratchDir root("ckpt-deadline");
  const testing::ScratchDir exported("ckpt-deadline-export");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());

  // The calls below take 2 to 30 times this on a machine like CI's (768 MiB each).
  const absl::Duration timeout = absl::Milliseconds(200);
  absl::Duration longest;
  auto quick = ConnectWith(cluster, {.timeout = timeout});
  ASSERT_TRUE(quick.ok()) << quick.status();
  ASSERT_TRUE((*quick)->ConfigureJob({}).ok());
  // Each call begins with small ones the timeout does bound (a save's and a load's status
  // fetch), which a loaded machine can make run out: a call that ends DeadlineExceeded
  // is made again, a few times. One that the timeout bounded as a whole would end so
  // every time.
  auto timed = [&](const char* what, const std::function<absl::Status()>& call) {
    absl::Status status;
    absl::Duration took;
    for (int attempt = 0; attempt < 5 && (attempt == 0 || absl::IsDeadlineExceeded(status)); ++attempt) {
      const absl::Time start = absl::Now();
      status = call();
      took = absl::Now() - start;
      std::cout << what << ": " << status << " in " << took << "\n";
    }
    EXPECT_TRUE(status.ok()) << what << ": " << status;
    longest = std::max(longest, took);
  };
  timed("register", [&] {
    return (*quick)->RegisterGroup("g", {{"w", {kNumel}, DType::kFloat32}}, 0, AdamOptions{}).status();
  });
  timed("seed", [&] { return (*quick)->InitGroupFromSeed("g", 7); });
  timed("save", [&] { return (*quick)->SaveCheckpoint("big", CheckpointKind::kFull, true); });
  timed("load", [&] { return (*quick)->LoadCheckpoint("big"); });
  timed("export", [&] { return (*quick)->ExportStateDict(exported.path(), CheckpointKind::kFull, true); });
  EXPECT_GT(longest, timeout) << "every call was too quick to show anything";

  // The wait for a cut that training never reaches stays bounded by the timeout, with
  // the servers' reason.
  const absl::Time start = absl::Now();
  const absl::Status never =
      (*quick)->SaveCheckpoint("never", CheckpointKind::kFull, false, false, nullptr, CutAt::Version(1000));
  EXPECT_FALSE(never.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << never;
  std::cout << "cut never reached: " << never << "\n";

  // model_timeout bounds the call as a whole; the servers serve on.
  auto bounded = ConnectWith(cluster, {.model_timeout = absl::Milliseconds(50)});
  ASSERT_TRUE(bounded.ok()) << bounded.status();
  const absl::Status cut_short = (*bounded)->ExportStateDict(exported.path() + "/short", CheckpointKind::kFull, true);
  EXPECT_TRUE(absl::IsDeadlineExceeded(cut_short)) << cut_short;
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    EXPECT_TRUE(status.ok()) << status.status();
  }
}

TEST(CheckpointDeadlineTest, OptionsOutsideTheirRangeAreRefused) {
  testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  const auto refused = [&](ClientOptions options) {
    options.servers = cluster.addresses();
    options.token = cluster.token();
    return Client::Connect(options).status();
  };
  const absl::Status keepalive = refused({.keepalive = absl::Milliseconds(500)});
  EXPECT_TRUE(absl::IsInvalidArgument(keepalive)) << keepalive;
  EXPECT_NE(keepalive.message().find("keepalive 500ms is below 1s"), absl::string_view::npos) << keepalive;
  const absl::Status none = refused({.model_timeout = absl::ZeroDuration()});
  EXPECT_TRUE(absl::IsInvalidArgument(none)) << none;
}

// A call that waits quietly for seconds (no data either way) while its client pings
// every second is served to its end: servers take such pings (gRPC's default would call
// the third one abuse and close the connection).
TEST(CheckpointDeadlineTest, PingsDuringALongQuietCallAreTaken) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  auto waiter = ConnectWith(cluster, {.timeout = absl::Seconds(30), .keepalive = absl::Seconds(1)});
  ASSERT_TRUE(waiter.ok()) << waiter.status();
  ASSERT_TRUE((*waiter)->ConfigureJob({}).ok());
  ASSERT_TRUE((*waiter)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
  ASSERT_TRUE((*waiter)->InitGroupFromSeed("g", 1).ok());
  std::future<absl::StatusOr<int64_t>> version =
      std::async(std::launch::async, [&] { return (*waiter)->WaitVersion("g", 1); });
  absl::SleepFor(absl::Seconds(5));
  const std::vector<float> grad(1000, 1.0f);
  ASSERT_TRUE((*waiter)
                  ->Scatter("g", 0, DType::kFloat32,
                            absl::MakeConstSpan(reinterpret_cast<const std::byte*>(grad.data()), grad.size() * 4))
                  .get()
                  .ok());
  const absl::StatusOr<int64_t> reached = version.get();
  ASSERT_TRUE(reached.ok()) << reached.status();
  EXPECT_EQ(*reached, 1);
}

// A server that stops answering (SIGSTOP) while it writes its part fails the save within
// twice the keepalive, instead of leaving its client waiting without end; resumed, it
// serves on, and the save was not committed.
TEST(CheckpointDeadlineTest, AServerThatHangsMidSaveFailsItWithinTwiceTheKeepalive) {
  const testing::ScratchDir root("ckpt-hang");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  auto client = ConnectWith(cluster, {.timeout = absl::Seconds(20), .keepalive = absl::Seconds(1)});
  ASSERT_TRUE(client.ok()) << client.status();
  RegisterBigGroup(**client);
  const ClientOptions status_of_1{.servers = {cluster.addresses()[1]}, .token = cluster.token()};
  bool hung = false;
  for (int attempt = 0; attempt < 3 && !hung; ++attempt) {
    const std::string name = "hang-" + std::to_string(attempt);
    std::future<absl::Status> save =
        std::async(std::launch::async, [&] { return (*client)->SaveCheckpoint(name, CheckpointKind::kFull, true); });
    // Pause server 1 once it writes its part.
    bool writing = false;
    while (!writing && save.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
      const auto status = FetchClusterStatus(status_of_1)[0];
      writing = status.ok() && status->checkpoints_in_progress_size() > 0;
    }
    if (!writing || !cluster.Pause(1)) {
      std::cout << "attempt " << attempt << ": the save finished first (" << save.get() << ")\n";
      continue;
    }
    hung = true;
    const absl::Time paused = absl::Now();
    const bool failed_in_time = save.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    const absl::Duration took = absl::Now() - paused;
    cluster.Resume(1);
    const absl::Status saved = save.get();
    std::cout << "save with server 1 paused: " << saved << " after " << took << "\n";
    EXPECT_TRUE(failed_in_time);
    EXPECT_TRUE(absl::IsUnavailable(saved)) << saved;
    EXPECT_LT(took, absl::Seconds(10));
    auto list = (*client)->ListCheckpoints();
    ASSERT_TRUE(list.ok()) << list.status();
    for (const CheckpointEntry& entry : *list) EXPECT_FALSE(entry.name == name && entry.complete) << name;
  }
  ASSERT_TRUE(hung) << "server 1 was never caught writing";
  // Both servers serve on: a save after it completes.
  EXPECT_TRUE((*client)->SaveCheckpoint("after", CheckpointKind::kSharded, false).ok());
}

// A load whose servers finish preparing far apart: server 0 reads its own root, server 1
// (a root of its own without the checkpoint) reads it from server 0 and is paused
// (SIGSTOP) mid-way for 3 times server 0's --staged_load_timeout. The client renews
// server 0's staging meanwhile, and the load commits on both. (The timeout is 2 s, so
// that a renewal, due at half of it, is not late on a machine busy with other tests: at
// 1 s one came late in a loaded run.)
TEST(CheckpointDeadlineTest, AServerThatPreparedWaitsForASlowOneWithoutDroppingTheLoad) {
  const testing::ScratchDir root0("ckpt-renew-0");
  const testing::ScratchDir root1("ckpt-renew-1");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root0.path(),
                               {{"--staged_load_timeout=2s"}, {"--checkpoint_root=" + root1.path()}});
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  RegisterBigGroup(**client);
  ASSERT_TRUE((*client)->SaveCheckpoint("slow", CheckpointKind::kFull, true).ok());
  const ClientOptions status_of_0{.servers = {cluster.addresses()[0]}, .token = cluster.token()};
  auto load_calls = [&]() -> uint64_t {  // LoadCheckpoint calls server 0 has answered
    const auto status = FetchClusterStatus(status_of_0)[0];
    if (!status.ok()) {
      ADD_FAILURE() << status.status();
      return 0;
    }
    for (const v1::NamedLatency& rpc : status->rpc_seconds()) {
      if (rpc.name() == "flatshard.v1.Flatshard/LoadCheckpoint") return rpc.seconds().count();
    }
    return 0;
  };
  bool renewed = false;
  for (int attempt = 0; attempt < 5 && !renewed; ++attempt) {
    const uint64_t calls_before = load_calls();
    std::future<absl::Status> load = std::async(std::launch::async, [&] { return (*client)->LoadCheckpoint("slow"); });
    // Pause server 1 once server 0 has staged the load (server 1 is likely still reading).
    bool staged = false;
    while (!staged && load.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
      const auto status = FetchClusterStatus(status_of_0)[0];
      staged = status.ok() && status->staged_loads_size() > 0;
    }
    const bool paused = staged && cluster.Pause(1);
    if (paused) {
      absl::SleepFor(absl::Seconds(6));
      cluster.Resume(1);
    }
    const absl::Status loaded = load.get();
    EXPECT_TRUE(loaded.ok()) << "attempt " << attempt << ": " << loaded;
    // Prepare and commit are 2 calls on server 0; more were renewals.
    const uint64_t calls = load_calls() - calls_before;
    std::cout << "attempt " << attempt << ": " << (paused ? "server 1 paused, " : "") << calls
              << " load calls on server 0\n";
    renewed = paused && calls > 2;
  }
  EXPECT_TRUE(renewed) << "server 1 never prepared long after server 0";
}

}  // namespace
}  // namespace flatshard
