// A checkpoint load while workers train, through the client against real server
// processes: whoever waits for a version that the load took away is told so at once,
// instead of at the end of the call's deadline, and a hybrid-sharded job trains on
// through loads at any moment to the bits of a run without them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/gpu_worker.h"
#include "tests/integration/test_cluster.h"
#include "tests/integration/trainer.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using testing::Operator;
using testing::Trainer;

// Runs `wait` on a thread and has `loader` load checkpoint `name` until `wait` returns:
// a load before the wait reaches the servers does not end it, the next one does. At most
// 30 loads, then the wait runs to its deadline. Returns the outcome of `wait`.
absl::Status LoadUntilItEnds(const std::function<absl::Status()>& wait, Client& loader, const std::string& name) {
  std::atomic<bool> done = false;
  absl::Status status;
  std::thread waiting([&] {
    status = wait();
    done = true;
  });
  for (int loads = 0; loads < 30 && !done; ++loads) {
    absl::SleepFor(absl::Milliseconds(100));
    const absl::Status loaded = loader.LoadCheckpoint(name);
    EXPECT_TRUE(loaded.ok()) << loaded;
  }
  waiting.join();
  return status;
}

// Two workers at version 1 of job "test"; worker 0 has sent its gradients for step 1,
// worker 1 not yet. An operator loads the checkpoint of version 1, which drops worker 0's
// gradients: version 2 now needs them again. Worker 0's wait for version 2 (WaitVersion
// on the control plane, a gather on the data plane) ends with ABORTED naming the loaded
// version, and so does a save whose cut waits for version 2 (FAILED_PRECONDITION). Worker
// 0's own save does not wait for the step its dropped gradient was for. Once both workers
// send step 1, training goes on from the loaded state.
TEST(LoadWhileTrainingTest, AWaitForAVersionTheLoadTookAwayEndsAtOnce) {
  const testing::ScratchDir root("load-while-training");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer first(cluster, 0, 2), second(cluster, 1, 2);
  ASSERT_TRUE(first.client->InitGroupFromSeed("big", 3).ok());
  ASSERT_TRUE(first.client->InitGroupFromSeed("tiny", 3).ok());
  std::unique_ptr<Client> loader = Operator(cluster), saver = Operator(cluster);
  ASSERT_NE(loader, nullptr);
  ASSERT_NE(saver, nullptr);
  first.Step(0);
  second.Step(0);
  ASSERT_TRUE(first.client->WaitVersion("tiny", 1).ok());
  ASSERT_TRUE(loader->SaveCheckpoint("at-1", CheckpointKind::kSharded, true).ok());
  const std::vector<float> big_at_1 = first.Params("big", first.big, 1);
  first.Step(1);

  const absl::Status waited =
      LoadUntilItEnds([&] { return first.client->WaitVersion("big", 2).status(); }, *loader, "at-1");
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_THAT(waited.message(),
              HasSubstr("group 'big' was loaded from a checkpoint at version 1 while waiting for version 2"));

  const absl::Status replaced =
      first.client->Scatter("big", 1, DType::kFloat32, AsBytes(first.Gradient("big", 1))).get();
  EXPECT_EQ(replaced.code(), absl::StatusCode::kAborted) << "a gradient of the replaced state: " << replaced;
  EXPECT_THAT(replaced.message(), HasSubstr("was computed from the state from before any checkpoint load; the group "
                                            "now holds the state of checkpoint load"));
  first.GatherAll(1);
  first.Step(1);  // sent again, from the loaded state: the load dropped it, so it is no duplicate
  std::vector<float> gathered(first.big->padded_numel());
  const absl::Status gather =
      LoadUntilItEnds([&] { return first.client->Gather("big", 2, DType::kFloat32, AsBytes(gathered)).get().status(); },
                      *loader, "at-1");
  EXPECT_EQ(gather.code(), absl::StatusCode::kAborted) << gather;
  EXPECT_THAT(gather.message(), HasSubstr("gather version 1 and train on from there"));

  const absl::Status saved = LoadUntilItEnds(
      [&] { return saver->SaveCheckpoint("at-2", CheckpointKind::kSharded, true, false, nullptr, CutAt::Version(2)); },
      *loader, "at-1");
  EXPECT_EQ(saved.code(), absl::StatusCode::kFailedPrecondition) << saved;
  EXPECT_THAT(saved.message(), HasSubstr("while waiting for the cut's version 2"));

  // Worker 0 sent step 1 last, between steps, but the load dropped it: its save does not
  // wait for step 1 to complete (only worker 0 itself would send what it needs) and holds
  // the loaded state.
  ASSERT_TRUE(first.client->SaveCheckpoint("reloaded", CheckpointKind::kSharded, true).ok());
  EXPECT_EQ(testing::ListedVersions(*loader)["reloaded"], (std::map<std::string, int64_t>{{"big", 1}, {"tiny", 1}}));

  EXPECT_EQ(first.Params("big", first.big, 1), big_at_1);
  first.GatherAll(1);
  second.GatherAll(1);
  first.Step(1);
  second.Step(1);
  EXPECT_TRUE(first.client->WaitVersion("big", 2).ok());
  EXPECT_TRUE(first.client->WaitVersion("tiny", 2).ok());
  ASSERT_TRUE(saver->SaveCheckpoint("at-2", CheckpointKind::kSharded, true).ok());
}

// A hybrid-sharded job (2 replica groups of 2 servers, a worker each) loaded back to the
// version of the step in progress, twice: once after worker 0's step went through its
// replica group's exchange (its partial is held by the other replica group's servers),
// once right after. Every server commits each load with the same id, so the step taken
// again is a new round of the exchange on all four, and lands on the bits of the run
// without the loads.
TEST(LoadWhileTrainingTest, AHybridJobTakesTheStepAgainAfterALoadToItsVersion) {
  const testing::ScratchDir root("load-while-training-hybrid");
  testing::TestCluster cluster(4, "tok", ::testing::TempDir(), root.path());
  const JobOptions hybrid{.replicas = 2};
  Trainer first(cluster, 0, 2, hybrid), second(cluster, 1, 2, hybrid);
  ASSERT_TRUE(first.client->InitGroupFromSeed("big", 5).ok());
  ASSERT_TRUE(first.client->InitGroupFromSeed("tiny", 5).ok());
  std::unique_ptr<Client> loader = Operator(cluster);
  ASSERT_NE(loader, nullptr);
  first.Step(0);
  second.Step(0);
  ASSERT_TRUE(first.client->WaitVersion("tiny", 1).ok());
  ASSERT_TRUE(loader->SaveCheckpoint("at-1", CheckpointKind::kSharded, true).ok());
  first.Step(1);
  second.Step(1);
  const std::vector<float> big_at_2 = first.Params("big", first.big, 2);
  const std::vector<float> tiny_at_2 = first.Params("tiny", first.tiny, 2);

  ASSERT_TRUE(loader->LoadCheckpoint("at-1").ok());
  first.GatherAll(1);
  first.Step(1);
  ASSERT_TRUE(loader->LoadCheckpoint("at-1").ok());
  first.GatherAll(1);
  second.GatherAll(1);
  first.Step(1);
  second.Step(1);
  EXPECT_EQ(first.Params("big", first.big, 2), big_at_2);
  EXPECT_EQ(second.Params("tiny", second.tiny, 2), tiny_at_2);
}

// Seeds `worker`'s groups, takes step 0, saves version 1 as checkpoint "at-1" (`big_at_1`:
// group "big" at version 1) and loads it as load 0x5eed on server 1 only (`cluster` has
// 2 servers).
void SaveAndLoadOnServerOne(Trainer& worker, testing::TestCluster& cluster, std::vector<float>& big_at_1) {
  ASSERT_TRUE(worker.client->InitGroupFromSeed("big", 3).ok());
  ASSERT_TRUE(worker.client->InitGroupFromSeed("tiny", 3).ok());
  worker.Step(0);
  ASSERT_TRUE(worker.client->SaveCheckpoint("at-1", CheckpointKind::kSharded, true).ok());
  big_at_1 = worker.Params("big", worker.big, 1);
  ASSERT_TRUE(cluster.LoadOnSome("test", "at-1", 0x5eed, {1}).ok());
}

void ExpectRefusedAsTorn(const absl::Status& refused) {
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("answered this gather from the states of two checkpoint loads ("));
  EXPECT_THAT(refused.message(), HasSubstr("load 5eed"));
  EXPECT_THAT(refused.message(), HasSubstr("did not commit on every server"));
}

// A gather whose servers answer from the states of different checkpoint loads (here a
// load committed on one server only; in training, a load committing while the gather
// reads) is refused, so no worker computes from half of each; once the load commits
// everywhere the worker gathers and trains on.
TEST(LoadWhileTrainingTest, AGatherFromTheStatesOfTwoLoadsIsRefused) {
  const testing::ScratchDir root("load-while-training-torn");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer worker(cluster);
  std::vector<float> big_at_1;
  ASSERT_NO_FATAL_FAILURE(SaveAndLoadOnServerOne(worker, cluster, big_at_1));
  std::vector<float> torn(worker.big->padded_numel());
  ExpectRefusedAsTorn(worker.client->Gather("big", 1, DType::kFloat32, AsBytes(torn)).get().status());

  ASSERT_TRUE(worker.client->LoadCheckpoint("at-1").ok());
  EXPECT_EQ(worker.Params("big", worker.big, 1), big_at_1);
  worker.GatherAll(1);
  worker.Step(1);
  EXPECT_TRUE(worker.client->WaitVersion("big", 2).ok());
}

// A worker that pushed a group's initial values computes its first gradient from them,
// without a gather: that gradient names the state it pushed, so once a checkpoint load
// replaced that state (here at the same version, 0) the servers refuse it instead of
// applying it to the loaded parameters. After a gather of the loaded state it is taken.
TEST(LoadWhileTrainingTest, AGradientOfPushedValuesThatALoadReplacedIsRefused) {
  const testing::ScratchDir root("load-after-push");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer worker(cluster);
  std::unique_ptr<Client> loader = Operator(cluster);
  ASSERT_NE(loader, nullptr);
  ASSERT_TRUE(worker.client->InitGroupFromSeed("tiny", 3).ok());
  ASSERT_TRUE(loader->SaveCheckpoint("at-0", CheckpointKind::kSharded, true).ok());
  ASSERT_TRUE(worker.client->InitGroup("tiny", std::vector<float>(worker.tiny->padded_numel(), 0.5f)).ok());
  ASSERT_TRUE(loader->LoadCheckpoint("at-0").ok());
  const std::vector<float> grad = worker.Gradient("tiny", 0);
  const absl::Status replaced = worker.client->Scatter("tiny", 0, DType::kFloat32, AsBytes(grad)).get();
  EXPECT_EQ(replaced.code(), absl::StatusCode::kAborted) << "a gradient of the pushed values: " << replaced;
  EXPECT_THAT(replaced.message(), HasSubstr("was computed from the state from before any checkpoint load"));
  std::vector<float> loaded(worker.tiny->padded_numel());
  ASSERT_EQ(worker.client->Gather("tiny", 0, DType::kFloat32, AsBytes(loaded)).get().value_or(-1), 0);
  EXPECT_TRUE(worker.client->Scatter("tiny", 0, DType::kFloat32, AsBytes(grad)).get().ok());
}

// The same refusal where the worker gathers into GPU memory from --memory=device servers,
// over CUDA IPC (the same GPU) and over NCCL (as between nodes): each server's answer
// carries its load, whichever plane moved the bytes.
TEST(LoadWhileTrainingTest, AGatherIntoGpuMemoryFromTheStatesOfTwoLoadsIsRefused) {
  if (!testing::HaveGpu()) GTEST_SKIP() << "the GPU planes need a CUDA build and a CUDA device";
  for (const DevicePlane plane : {DevicePlane::kCudaIpc, DevicePlane::kNccl}) {
    const bool nccl = plane == DevicePlane::kNccl;
    if (nccl && !testing::HaveNccl()) continue;  // NCCL does not load here
    SCOPED_TRACE(nccl ? "nccl" : "cuda-ipc");
    const testing::ScratchDir root("load-while-training-torn-gpu");
    if (nccl) testing::SetNcclHost(testing::kNcclServers);
    testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path(),
                                 {{"--memory=device"}, {"--memory=device"}});
    if (nccl) testing::SetNcclHost(testing::kNcclWorkers);
    Trainer worker(cluster, 0, 1, {}, absl::Seconds(20), plane);
    ASSERT_EQ(worker.client->DataPlanes(), std::vector<std::string>(2, nccl ? "nccl" : "cuda-ipc"));
    std::vector<float> big_at_1;
    ASSERT_NO_FATAL_FAILURE(SaveAndLoadOnServerOne(worker, cluster, big_at_1));
    testing::DeviceBytes torn(worker.big->padded_numel() * sizeof(float));
    ExpectRefusedAsTorn(worker.client->Gather("big", 1, DType::kFloat32, torn.span()).get().status());

    ASSERT_TRUE(worker.client->LoadCheckpoint("at-1").ok());
    testing::DeviceBytes whole(worker.big->padded_numel() * sizeof(float));
    const absl::StatusOr<int64_t> version = worker.client->Gather("big", 1, DType::kFloat32, whole.span()).get();
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(*version, 1);
    std::vector<float> gathered(worker.big->padded_numel());
    whole.Download(AsBytes(gathered));
    gathered.resize(worker.big->unpadded_numel());
    EXPECT_EQ(gathered, big_at_1);
  }
}

// Trains `trainer` up to version `target` of both its groups, following the servers
// through loads, until `stop` is set with both groups at `target`: each round gathers
// every group at the lowest version among them and sends its gradient (a group a step
// ahead has it already), then waits for that step to complete. What a load voids (a refused or aborted
// transfer, a wait it ended or that ran out while the step waited for a gradient the
// load dropped) just starts the next round at the servers' versions; a gradient the
// servers hold already is ALREADY_EXISTS. Any other error ends it, and so does a minute
// without reaching the end.
absl::Status FollowTheServers(Trainer& trainer, int64_t target, const std::atomic<bool>& stop) {
  Client& client = *trainer.client;
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (absl::Now() < give_up) {
    std::map<std::string, int64_t> versions;
    for (const std::string name : {"big", "tiny"}) {
      absl::StatusOr<int64_t> version = client.WaitVersion(name, 0);
      if (!version.ok()) return version.status();
      versions[name] = *version;
    }
    const int64_t step = std::min(versions["big"], versions["tiny"]);
    if (step >= target) {
      if (stop) return absl::OkStatus();
      absl::SleepFor(absl::Milliseconds(5));  // until a load takes the job back
      continue;
    }
    absl::SleepFor(absl::Milliseconds(10));  // steps of 10 ms or more, for the loads to land in
    // Success, or what a load may make of a transfer or a wait.
    auto expected = [](const absl::Status& status) {
      return status.ok() || absl::IsAlreadyExists(status) || absl::IsAborted(status) ||
             absl::IsFailedPrecondition(status) || absl::IsDeadlineExceeded(status);
    };
    bool went_on = true;
    for (const auto& [name, version] : versions) {
      if (version != step) continue;
      std::vector<float> params(name == "big" ? trainer.big->padded_numel() : trainer.tiny->padded_numel());
      const absl::StatusOr<int64_t> gathered = client.Gather(name, step, DType::kFloat32, AsBytes(params)).get();
      if (!expected(gathered.status())) return gathered.status();
      if (!gathered.ok() || *gathered != step) {  // a load moved the group
        went_on = false;
        break;
      }
      const std::vector<float> grad = trainer.Gradient(name, step);
      const absl::Status sent = client.Scatter(name, step, DType::kFloat32, AsBytes(grad)).get();
      if (!expected(sent)) return sent;
      went_on &= sent.ok() || absl::IsAlreadyExists(sent);
    }
    for (const auto& [name, version] : versions) {
      if (!went_on) break;
      const absl::Status waited = client.WaitVersion(name, step + 1).status();
      if (!expected(waited)) return waited;
      went_on = waited.ok();
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("worker ", trainer.worker, " did not reach version ", target));
}

// A job of two workers on four servers trains towards version 30 while an operator saves
// it and loads one of its checkpoints (optimizer state included) at random moments, eight
// times (every other one non-strict, which into the same groups must come to the same);
// once it is done the workers train on to version 30. The gradients depend on the
// step only, so version 30 must hold the bits of the run without loads, whatever the
// loads interrupted: a scatter, a wait, the exchange between replica groups (hybrid
// sharding: 2 replica groups of 2 servers, a worker each), the servers' shares of the
// global gradient norm (clipping). Seeded by FLATSHARD_CHECKPOINT_SEED.
class LoadsAtRandomMomentsTest : public ::testing::TestWithParam<JobOptions> {};

TEST_P(LoadsAtRandomMomentsTest, TrainingEndsOnTheBitsOfARunWithoutLoads) {
  constexpr int64_t kTarget = 30;
  const char* seed_text = std::getenv("FLATSHARD_CHECKPOINT_SEED");
  const uint64_t seed = seed_text != nullptr ? std::strtoull(seed_text, nullptr, 10) : 7;
  SCOPED_TRACE(absl::StrCat("FLATSHARD_CHECKPOINT_SEED=", seed));
  std::mt19937_64 random(seed);
  const testing::ScratchDir root("load-while-training-random");
  testing::TestCluster cluster(4, "tok", ::testing::TempDir(), root.path());
  // Short deadlines: a wait that a load left without its end runs out soon.
  Trainer first(cluster, 0, 2, GetParam(), absl::Seconds(2)), second(cluster, 1, 2, GetParam(), absl::Seconds(2));
  ASSERT_TRUE(first.client->InitGroupFromSeed("big", 9).ok());
  ASSERT_TRUE(first.client->InitGroupFromSeed("tiny", 9).ok());
  std::unique_ptr<Client> loader = Operator(cluster);
  ASSERT_NE(loader, nullptr);
  ASSERT_TRUE(loader->SaveCheckpoint("start", CheckpointKind::kSharded, true).ok());
  for (int64_t step = 0; step < kTarget; ++step) {
    first.Step(step);
    second.Step(step);
  }
  ASSERT_TRUE(first.client->WaitVersion("big", kTarget).ok());
  ASSERT_TRUE(first.client->WaitVersion("tiny", kTarget).ok());
  const std::vector<float> big = first.Params("big", first.big, kTarget);
  const std::vector<float> tiny = first.Params("tiny", first.tiny, kTarget);

  ASSERT_TRUE(loader->LoadCheckpoint("start").ok());
  absl::Status followed[2];
  std::thread workers[2];
  Trainer* trainers[2] = {&first, &second};
  std::atomic<bool> stop = false;
  for (int w = 0; w < 2; ++w) {
    workers[w] = std::thread([&, w] { followed[w] = FollowTheServers(*trainers[w], kTarget, stop); });
  }
  std::vector<std::string> saved = {"start"};
  for (int load = 0; load < 8; ++load) {
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(0, 150)(random)));
    // Cut where the groups are: one may be a step ahead of the other.
    const std::string name = absl::StrCat("random-", load);
    const absl::Status save = loader->SaveCheckpoint(name, CheckpointKind::kSharded, true);
    EXPECT_TRUE(save.ok()) << save;
    if (save.ok()) saved.push_back(name);
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(0, 150)(random)));
    const std::string& back = saved[std::uniform_int_distribution<size_t>(0, saved.size() - 1)(random)];
    if (load % 2 == 0) {
      const absl::Status loaded = loader->LoadCheckpoint(back);
      EXPECT_TRUE(loaded.ok()) << back << ": " << loaded;
    } else {  // into the same groups, a non-strict load is a strict one
      const absl::StatusOr<IncompatibleTensors> loaded = loader->LoadCheckpointNonStrict(back);
      EXPECT_TRUE(loaded.ok()) << back << ": " << loaded.status();
      if (loaded.ok()) {
        EXPECT_TRUE(loaded->missing.empty() && loaded->unexpected.empty());
      }
    }
  }
  stop = true;
  for (int w = 0; w < 2; ++w) {
    workers[w].join();
    EXPECT_TRUE(followed[w].ok()) << "worker " << w << ": " << followed[w];
  }
  EXPECT_EQ(first.Params("big", first.big, kTarget), big);
  EXPECT_EQ(second.Params("tiny", second.tiny, kTarget), tiny);
}

INSTANTIATE_TEST_SUITE_P(Jobs, LoadsAtRandomMomentsTest,
                         ::testing::Values(JobOptions{.replicas = 2}, JobOptions{.max_grad_norm = 0.5, .replicas = 2},
                                           JobOptions{.max_grad_norm = 0.5}),
                         [](const ::testing::TestParamInfo<JobOptions>& info) {
                           return absl::StrCat(info.param.replicas > 1 ? "Hybrid" : "Plain",
                                               info.param.max_grad_norm > 0 ? "Clipped" : "");
                         });

}  // namespace
}  // namespace flatshard
