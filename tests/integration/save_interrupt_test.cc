// A blocking save whose client goes away mid-write (Ctrl-C on `flatshard save`): the
// servers, which would write on for a part no one will commit while the job's groups stay
// pinned, stop within a slice, remove what they wrote and release the pins and the name.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/cluster_status.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

namespace fs = std::filesystem;

// Whether a checkpoint file of a save of `name` is under way in `root`.
bool SaveFileIn(const std::string& root, const std::string& name) {
  std::error_code error;  // the directory may come or go meanwhile
  for (fs::recursive_directory_iterator it(root + "/." + name + ".partial", error), end; !error && it != end;
       it.increment(error)) {
    if (absl::EndsWith(it->path().filename().string(), ".safetensors")) return true;
  }
  return false;
}

// Whether any server of `cluster` still lists a save, load or export in progress.
bool AnyInProgress(const testing::TestCluster& cluster) {
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    if (!status.ok() || status->checkpoints_in_progress_size() > 0) return true;
  }
  return false;
}

TEST(SaveInterruptTest, ABlockingSaveWhoseClientGoesAwayStopsAndLeavesNothing) {
  const testing::ScratchDir root_dir("save-interrupted");
  const std::string root = root_dir.path();
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root);
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  // 1 GiB of parameters: each server writes 512 MiB, in 4 MiB slices.
  constexpr int64_t kElements = int64_t{256} << 20;
  ASSERT_TRUE((*client)->RegisterGroup("big", {{"w", {kElements}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
  ASSERT_TRUE((*client)->InitGroupFromSeed("big", 3).ok());

  std::vector<std::string> args = cluster.CommandFlags();
  args.insert(args.begin(), "save");
  args.insert(args.end(), {"--job=test", "--kind=sharded", "--name=x"});
  const pid_t pid = testing::SpawnProcess(FLATSHARD_CLI_PATH, args);
  ASSERT_GT(pid, 0);
  int status = 0;
  bool exited = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!SaveFileIn(root, "x") && !exited && absl::Now() < deadline) {
    exited = waitpid(pid, &status, WNOHANG) == pid;
    absl::SleepFor(absl::Microseconds(200));
  }
  ASSERT_FALSE(exited) << "the save ended (status " << status << ") before it was seen writing";
  kill(pid, SIGINT);
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << status;

  for (const absl::Time until = absl::Now() + absl::Seconds(60); AnyInProgress(cluster) && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  // Written to the end, the part would stay, listed as an incomplete checkpoint.
  const auto listed = (*client)->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << (*listed)[0].name << " complete: " << (*listed)[0].complete;
  EXPECT_FALSE(fs::exists(root + "/.x.partial"));

  // The groups are no longer pinned: a step goes through; and the name is free.
  const std::vector<float> grad(kElements, 0.5f);
  const absl::Status stepped = (*client)->Scatter("big", 0, DType::kFloat32, AsBytes(grad)).get();
  ASSERT_TRUE(stepped.ok()) << stepped;
  EXPECT_EQ((*client)->WaitVersion("big", 1).value_or(-1), 1);
  const absl::Status saved = (*client)->SaveCheckpoint("x", CheckpointKind::kSharded, false);
  EXPECT_TRUE(saved.ok()) << saved;
}

}  // namespace
}  // namespace flatshard
