// Where a save or export cuts the job's groups (CutAt), through the client against real
// server processes: an operator's cut at the step boundary or at a version while workers
// train, and the cuts that cannot be made.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <sstream>
#include <string>

#include "client/cli/checkpoint_command.h"
#include "core/file.h"
#include "tests/integration/test_cluster.h"
#include "tests/integration/trainer.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using testing::ListedVersions;
using testing::MustWaitFor;
using testing::Operator;
using testing::Trainer;

// Two workers in an unclipped job, the second one late with "tiny": "big" has taken the
// step, "tiny" has not. The operator's default cut mixes the two; its cut at the step
// boundary waits for "tiny" and holds the state after the step, for a save and for an
// export, which loads back exactly.
TEST(CheckpointCutTest, AnOperatorsCutAtTheStepBoundaryWaitsForTheStepInProgress) {
  const testing::ScratchDir root("cut-boundary");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer first(cluster, 0, 2), second(cluster, 1, 2);
  ASSERT_TRUE(first.client->InitGroupFromSeed("big", 3).ok());
  ASSERT_TRUE(first.client->InitGroupFromSeed("tiny", 3).ok());
  std::unique_ptr<Client> operator_client = Operator(cluster);
  ASSERT_NE(operator_client, nullptr);
  auto into_step = [&](int64_t step) {
    first.Step(step);
    second.Send("big", step);
    EXPECT_TRUE(first.client->WaitVersion("big", step + 1).ok());
  };

  into_step(0);
  ASSERT_TRUE(operator_client->SaveCheckpoint("now", CheckpointKind::kSharded, true).ok());
  const absl::Status saved = MustWaitFor(
      [&] {
        return operator_client->SaveCheckpoint("boundary", CheckpointKind::kSharded, true, false, nullptr,
                                               CutAt::StepBoundary());
      },
      [&] { second.Send("tiny", 0); }, "'tiny' to take step 0");
  ASSERT_TRUE(saved.ok()) << saved;
  const std::vector<float> big = first.Params("big", first.big, 1), tiny = first.Params("tiny", first.tiny, 1);
  EXPECT_EQ(ListedVersions(*operator_client),
            (std::map<std::string, std::map<std::string, int64_t>>{{"now", {{"big", 1}, {"tiny", 0}}},
                                                                   {"boundary", {{"big", 1}, {"tiny", 1}}}}));

  into_step(1);
  const testing::ScratchDir exported("cut-boundary-export");
  const absl::Status streamed = MustWaitFor(
      [&] {
        return operator_client->ExportStateDict(exported.path(), CheckpointKind::kFull, false, nullptr,
                                                CutAt::StepBoundary());
      },
      [&] { second.Send("tiny", 1); }, "'tiny' to take step 1");
  ASSERT_TRUE(streamed.ok()) << streamed;
  ASSERT_TRUE(operator_client->SaveCheckpoint("after-1", CheckpointKind::kFull, false).ok());  // at {2, 2}
  EXPECT_EQ(ListedVersions(*operator_client)["after-1"], (std::map<std::string, int64_t>{{"big", 2}, {"tiny", 2}}));
  const absl::StatusOr<std::string> streamed_model = ReadFileToString(exported.path() + "/model.safetensors");
  ASSERT_TRUE(streamed_model.ok()) << streamed_model.status();
  EXPECT_EQ(*streamed_model, ReadFileToString(root.path() + "/after-1/model.safetensors").value_or(""));

  ASSERT_TRUE(operator_client->LoadCheckpoint("boundary").ok());
  EXPECT_EQ(first.Params("big", first.big, 1), big);
  EXPECT_EQ(first.Params("tiny", first.tiny, 1), tiny);
}

// A cut at a version waits for training to reach it and holds exactly that state (frozen
// groups at theirs); a version that a group has passed is refused, naming the group, and
// one that training never reaches times out saying so. Training and saving go on.
TEST(CheckpointCutTest, ACutAtAVersionWaitsForItAndRefusesOnePassed) {
  const testing::ScratchDir root("cut-version");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer worker(cluster);
  ASSERT_TRUE(worker.client->RegisterGroup("embed", {{"embedding", {3}, DType::kFloat32}}, 0, FrozenOptions{}).ok());
  ASSERT_TRUE(worker.client->InitGroupFromSeed("big", 5).ok());
  worker.Step(0);
  std::unique_ptr<Client> operator_client = Operator(cluster);
  ASSERT_NE(operator_client, nullptr);
  const absl::Status saved = MustWaitFor(
      [&] {
        return operator_client->SaveCheckpoint("at-3", CheckpointKind::kFull, true, false, nullptr, CutAt::Version(3));
      },
      [&] {
        worker.Step(1);
        worker.Step(2);
      },
      "version 3");
  ASSERT_TRUE(saved.ok()) << saved;
  const std::vector<float> big = worker.Params("big", worker.big, 3), tiny = worker.Params("tiny", worker.tiny, 3);
  worker.Step(3);
  EXPECT_EQ(ListedVersions(*operator_client)["at-3"],
            (std::map<std::string, int64_t>{{"big", 3}, {"embed", 0}, {"tiny", 3}}));

  const absl::Status passed =
      operator_client->SaveCheckpoint("at-3-again", CheckpointKind::kFull, true, false, nullptr, CutAt::Version(3));
  EXPECT_TRUE(absl::IsFailedPrecondition(passed)) << passed;
  EXPECT_THAT(std::string(passed.message()), HasSubstr("is at version 4, past the cut at version 3"));
  const absl::Status negative = operator_client->ExportStateDict(root.path() + "/unused", CheckpointKind::kFull, false,
                                                                 nullptr, CutAt::Version(-1));
  EXPECT_TRUE(absl::IsInvalidArgument(negative)) << negative;

  std::unique_ptr<Client> impatient = Operator(cluster, absl::Seconds(4));
  ASSERT_NE(impatient, nullptr);
  const absl::Status never =
      impatient->SaveCheckpoint("at-9", CheckpointKind::kLocal, false, false, nullptr, CutAt::Version(9));
  EXPECT_TRUE(absl::IsDeadlineExceeded(never)) << never;
  EXPECT_THAT(std::string(never.message()), HasSubstr("the cut is at version 9; is the job training towards it?"));
  worker.Step(4);
  ASSERT_TRUE(testing::AwaitNoCheckpointInProgress(cluster));
  const absl::Status at_9 = operator_client->SaveCheckpoint("at-9", CheckpointKind::kLocal, false);
  ASSERT_TRUE(at_9.ok()) << at_9;

  ASSERT_TRUE(operator_client->LoadCheckpoint("at-3").ok());
  EXPECT_EQ(worker.Params("big", worker.big, 3), big);
  EXPECT_EQ(worker.Params("tiny", worker.tiny, 3), tiny);

  // `flatshard save --cut=...`
  cli::CheckpointCommandOptions command;
  command.command = "save";
  command.servers = cluster.addresses();
  command.token = "tok";
  command.job = "test";
  command.name = "cli";
  std::ostringstream out, err;
  command.cut = "3";
  EXPECT_EQ(cli::RunCheckpointCommand(command, out, err), 0) << err.str();
  EXPECT_THAT(out.str(), HasSubstr("save 'cli': done in"));
  EXPECT_THAT(out.str(), HasSubstr(", groups at big@3 embed@0 tiny@3\n"));
  command.cut = "soon";
  EXPECT_EQ(cli::RunCheckpointCommand(command, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--cut must be now, boundary or a version"));
  EXPECT_EQ(ListedVersions(*operator_client)["cli"],
            (std::map<std::string, int64_t>{{"big", 3}, {"embed", 0}, {"tiny", 3}}));
}

// There is no step boundary to cut at inside the caller's own step (it would wait for
// the caller's own gradients), between groups more than a step apart (they do not step
// together) or in an async job (each gradient steps on its own).
TEST(CheckpointCutTest, AStepBoundaryIsRefusedWhereThereIsNone) {
  const testing::ScratchDir root("cut-no-boundary");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer worker(cluster);
  worker.Send("big", 0);
  const absl::Status inside =
      worker.client->SaveCheckpoint("x", CheckpointKind::kLocal, false, false, nullptr, CutAt::StepBoundary());
  EXPECT_TRUE(absl::IsFailedPrecondition(inside)) << inside;
  EXPECT_THAT(std::string(inside.message()), HasSubstr("this client is inside a step"));
  worker.Send("big", 1);
  std::unique_ptr<Client> operator_client = Operator(cluster);
  ASSERT_NE(operator_client, nullptr);
  const absl::Status apart =
      operator_client->SaveCheckpoint("x", CheckpointKind::kLocal, false, false, nullptr, CutAt::StepBoundary());
  EXPECT_TRUE(absl::IsFailedPrecondition(apart)) << apart;
  EXPECT_THAT(std::string(apart.message()), HasSubstr("versions 0 ('tiny') to 2 ('big')"));
  EXPECT_TRUE(ListedVersions(*operator_client).empty());

  const testing::ScratchDir async_root("cut-async");
  testing::TestCluster async_cluster(1, "tok", ::testing::TempDir(), async_root.path());
  Trainer async_worker(async_cluster, 0, 1, JobOptions{.async = true});
  async_worker.Step(0);
  std::unique_ptr<Client> async_operator = Operator(async_cluster);
  ASSERT_NE(async_operator, nullptr);
  const absl::Status async = async_operator->ExportStateDict(async_root.path() + "/unused", CheckpointKind::kFull,
                                                             false, nullptr, CutAt::StepBoundary());
  EXPECT_TRUE(absl::IsFailedPrecondition(async)) << async;
  EXPECT_THAT(std::string(async.message()), HasSubstr("job 'test' is asynchronous"));
  EXPECT_TRUE(
      async_operator->SaveCheckpoint("at-1", CheckpointKind::kSharded, true, false, nullptr, CutAt::Version(1)).ok());
}

}  // namespace
}  // namespace flatshard
