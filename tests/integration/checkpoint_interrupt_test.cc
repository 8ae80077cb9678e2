// A save, load, export or import that its client cancels (Client::CancelCheckpointCalls; Ctrl-C
// on the `flatshard` command) or whose client dies while the servers work: the servers,
// which would go on for a part no one will commit (a save, with the job's groups pinned)
// or a staged copy of the shards no one will install (a load), stop within a slice, keep
// nothing, and release what they held.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/cluster_status.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

namespace fs = std::filesystem;

// 1 GiB of parameters: each of two servers saves or loads 512 MiB.
constexpr int64_t kElements = int64_t{256} << 20;

class CheckpointInterruptTest : public ::testing::Test {
 protected:
  CheckpointInterruptTest() : cluster_(2, "tok", ::testing::TempDir(), root_.path()) {
    auto client = cluster_.Connect(0, 1);
    EXPECT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    EXPECT_TRUE(client_->ConfigureJob({}).ok());
    EXPECT_TRUE(client_->RegisterGroup("big", {{"w", {kElements}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
    EXPECT_TRUE(client_->InitGroupFromSeed("big", 3).ok());
  }

  // Every server's status (an empty one for a server that did not answer).
  std::vector<v1::ServerStatus> Statuses() const {
    std::vector<v1::ServerStatus> statuses;
    for (auto& status : FetchClusterStatus({.servers = cluster_.addresses(), .token = cluster_.token()})) {
      statuses.push_back(status.ok() ? *std::move(status) : v1::ServerStatus());
    }
    return statuses;
  }

  // Waits (up to 60 s) until no server lists a save, load or export in progress.
  void AwaitIdle() const {
    auto busy = [&] {
      for (const v1::ServerStatus& status : Statuses()) {
        if (status.checkpoints_in_progress_size() > 0) return true;
      }
      return false;
    };
    for (const absl::Time until = absl::Now() + absl::Seconds(60); busy() && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // A training step of the one-worker job goes through: no group is pinned.
  void ExpectAStep() const {
    const absl::StatusOr<int64_t> version = client_->WaitVersion("big", 0);
    ASSERT_TRUE(version.ok()) << version.status();
    const std::vector<float> grad(kElements, 0.5f);
    const absl::Status stepped = client_->Scatter("big", *version, DType::kFloat32, AsBytes(grad)).get();
    ASSERT_TRUE(stepped.ok()) << stepped;
    EXPECT_EQ(client_->WaitVersion("big", *version + 1).value_or(-1), *version + 1);
  }

  // After a save of "x" that was stopped: once the servers are idle, nothing of it is
  // listed or left on disk (written to the end, its part would stay, listed as an
  // incomplete checkpoint), the groups are no longer pinned (a step goes through), and
  // the name is free.
  void ExpectTheSaveLeftNothing() const {
    AwaitIdle();
    const auto listed = client_->ListCheckpoints();
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_TRUE(listed->empty()) << (*listed)[0].name << " complete: " << (*listed)[0].complete;
    EXPECT_FALSE(fs::exists(root_.path() + "/.x.partial"));
    ExpectAStep();
    const absl::Status saved = client_->SaveCheckpoint("x", CheckpointKind::kSharded, false);
    EXPECT_TRUE(saved.ok()) << saved;
  }

  // Runs `call` while another thread waits until `started()`, then has the client cancel
  // its checkpoint calls with every server paused (none can finish first); returns what
  // `call` returned.
  absl::Status CancelledOnceStarted(const std::function<absl::Status()>& call, const std::function<bool()>& started) {
    std::thread canceller([&] {
      for (const absl::Time until = absl::Now() + absl::Seconds(60); !started() && absl::Now() < until;) {
        absl::SleepFor(absl::Microseconds(200));
      }
      EXPECT_TRUE(cluster_.WhilePaused([&] { client_->CancelCheckpointCalls(); }));
    });
    const absl::Status status = call();
    canceller.join();
    return status;
  }

  // Whether some server reads a load with bytes done.
  bool Loading() const {
    for (const v1::ServerStatus& status : Statuses()) {
      for (const v1::CheckpointProgress& row : status.checkpoints_in_progress()) {
        if (row.operation() == "load" && row.done() > 0) return true;
      }
    }
    return false;
  }

  const testing::ScratchDir root_{"checkpoint-interrupted"};
  testing::TestCluster cluster_;
  std::unique_ptr<Client> client_;
};

// Whether a checkpoint file of a save of `name` is being written in `root`.
bool SaveFileIn(const std::string& root, const std::string& name) {
  std::error_code error;  // the directory may come or go meanwhile
  for (fs::recursive_directory_iterator it(root + "/." + name + ".partial", error), end; !error && it != end;
       it.increment(error)) {
    if (absl::EndsWith(it->path().filename().string(), ".safetensors")) return true;
  }
  return false;
}

TEST_F(CheckpointInterruptTest, CtrlCOnABlockingSaveStopsItAndLeavesNothing) {
  const absl::StatusOr<int> status = cluster_.InterruptCommand("save", {"--job=test", "--kind=sharded", "--name=x"},
                                                               [&](pid_t) { return SaveFileIn(root_.path(), "x"); });
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 130) << *status;
  ExpectTheSaveLeftNothing();
}

TEST_F(CheckpointInterruptTest, ALoadWhoseClientIsKilledStopsAndStagesNothing) {
  ASSERT_TRUE(client_->SaveCheckpoint("x", CheckpointKind::kSharded, false).ok());
  const absl::StatusOr<int> status = cluster_.InterruptCommand(
      "load", {"--job=test", "--name=x"}, [&](pid_t) { return Loading(); }, /*sigkill=*/true);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << *status;
  AwaitIdle();
  // Read to the end, the load would stay staged, a copy of the shards, for its commit.
  for (const v1::ServerStatus& server : Statuses()) EXPECT_EQ(server.staged_loads_size(), 0);
  ExpectAStep();
  const absl::Status loaded = client_->LoadCheckpoint("x");
  EXPECT_TRUE(loaded.ok()) << loaded;
}

TEST_F(CheckpointInterruptTest, ASaveCancelledWhileTheServersWriteKeepsNothing) {
  const absl::Status saved =
      CancelledOnceStarted([&] { return client_->SaveCheckpoint("x", CheckpointKind::kFull, true); },
                           [&] { return SaveFileIn(root_.path(), "x"); });
  EXPECT_TRUE(absl::IsCancelled(saved)) << saved;
  EXPECT_EQ(std::string(saved.message()), "the save of checkpoint 'x' was cancelled; the servers keep nothing of it");
  ExpectTheSaveLeftNothing();
}

TEST_F(CheckpointInterruptTest, ASaveCancelledOnceEveryPartIsWrittenKeepsNothing) {
  // The last progress report, every byte written, comes once every server has answered
  // that its part is written, just before the commit. The servers are held for a moment
  // mid-save, so that the progress poller reports before it (it first asks at 200 ms).
  std::thread hold([&] {
    for (const absl::Time until = absl::Now() + absl::Seconds(60);
         !SaveFileIn(root_.path(), "x") && absl::Now() < until;) {
      absl::SleepFor(absl::Microseconds(200));
    }
    EXPECT_TRUE(cluster_.WhilePaused([] { absl::SleepFor(absl::Milliseconds(300)); }));
  });
  bool cancelled_when_written = false;
  const absl::Status saved =
      client_->SaveCheckpoint("x", CheckpointKind::kSharded, false, false, [&](uint64_t done, uint64_t total) {
        if (done < total || cancelled_when_written) return;
        cancelled_when_written = true;
        client_->CancelCheckpointCalls();
      });
  hold.join();
  ASSERT_TRUE(cancelled_when_written);
  EXPECT_TRUE(absl::IsCancelled(saved)) << saved;
  EXPECT_EQ(std::string(saved.message()), "the save of checkpoint 'x' was cancelled; the servers keep nothing of it");
  ExpectTheSaveLeftNothing();  // server 0, which the commit would have gone to, removed every part
}

TEST_F(CheckpointInterruptTest, ALoadCancelledWhileTheServersReadInstallsNothing) {
  ASSERT_TRUE(client_->SaveCheckpoint("x", CheckpointKind::kSharded, false).ok());
  ExpectAStep();  // version 1; the checkpoint holds version 0
  const absl::Status loaded =
      CancelledOnceStarted([&] { return client_->LoadCheckpoint("x"); }, [&] { return Loading(); });
  EXPECT_TRUE(absl::IsCancelled(loaded)) << loaded;
  AwaitIdle();
  for (const v1::ServerStatus& server : Statuses()) EXPECT_EQ(server.staged_loads_size(), 0);
  EXPECT_EQ(client_->WaitVersion("big", 0).value_or(-1), 1);  // not rolled back
}

// Ctrl-C on `flatshard import` while server 0 writes the files (its status lists the
// import, part of its bytes received): it drops them, and once it lists the import no
// more, nothing of it is listed or left in its root; the name is free.
TEST_F(CheckpointInterruptTest, CtrlCOnAnImportLeavesNothing) {
  const testing::ScratchDir exported("import-interrupted");
  ASSERT_TRUE(client_->ExportStateDict(exported.path(), CheckpointKind::kFull, false).ok());
  // Under way once server 0 lists it with bytes received (of a total announced).
  const absl::StatusOr<int> status =
      cluster_.InterruptCommand("import", {"--name=x", "--in=" + exported.path()}, [&](pid_t) {
        const std::vector<v1::ServerStatus> statuses = Statuses();
        for (const v1::CheckpointProgress& row : statuses[0].checkpoints_in_progress()) {
          if (row.name() == "x" && row.operation() == "import" && row.done() > 0 && row.total() > row.done()) {
            return true;
          }
        }
        return false;
      });
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 130) << *status;
  AwaitIdle();
  const auto listed = client_->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << (*listed)[0].name << " complete: " << (*listed)[0].complete;
  EXPECT_FALSE(fs::exists(root_.path() + "/.x.partial"));
  const absl::StatusOr<ImportedCheckpoint> imported = client_->ImportCheckpoint("x", exported.path());
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->groups, std::vector<std::string>{"imported"});
}

TEST_F(CheckpointInterruptTest, AnExportCancelledFromItsProgressNamesNoFile) {
  const testing::ScratchDir out("export-cancelled");
  const absl::Status exported = client_->ExportStateDict(out.path(), CheckpointKind::kFull, false,
                                                         [&](uint64_t, uint64_t) { client_->CancelCheckpointCalls(); });
  EXPECT_TRUE(absl::IsCancelled(exported)) << exported;
  EXPECT_TRUE(fs::is_empty(out.path()));
  ASSERT_TRUE(client_->ExportStateDict(out.path(), CheckpointKind::kSharded, false).ok());
  EXPECT_TRUE(fs::exists(out.path() + "/shard-1.safetensors"));
}

}  // namespace
}  // namespace flatshard
