// The step engine without a network: exactly-once contributions, rank-order reduction,
// version waits, initialization.
#include "server/group.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/float_bits.h"
#include "kernels/kernels.h"
#include "server/registry.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<Group> MakeGroup(int workers, bool mean = true, int rank = 0, int shards = 2) {
  auto layout = FlatLayout::Create({{"w", {3}, DType::kFloat32}, {"b", {2}, DType::kFloat32}}, 0, shards);
  return *Group::Create("job", "g", *layout, Placement::Of(rank, shards, 1), JobSettings{.num_workers = workers, .reduce_mean = mean},
               kernels::SgdHyperparams{.lr = 1.0f});
}

absl::Status Contribute(Group& group, int64_t step, int worker, const std::vector<float>& grad) {
  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker, DType::kFloat32);
  if (!slot.ok()) return slot.status();
  std::memcpy(slot->buffer.data(), grad.data(), slot->buffer.size());
  return group.CommitScatter(*slot).status();
}

std::vector<float> Params(Group& group) {
  absl::StatusOr<GatherSnapshot> snapshot = group.Gather(0, DType::kFloat32, absl::InfiniteFuture());
  std::vector<float> values(group.shard_numel());
  std::memcpy(values.data(), snapshot->bytes->data(), snapshot->bytes->size());
  return values;
}

TEST(GroupTest, StepAppliesOnceAllWorkersContributed) {
  std::shared_ptr<Group> group_owner = MakeGroup(3, /*mean=*/false);
  Group& group = *group_owner;
  ASSERT_EQ(group.shard_numel(), 3);
  ASSERT_TRUE(Contribute(group, 0, 2, {1, 2, 3}).ok());
  ASSERT_TRUE(Contribute(group, 0, 0, {10, 20, 30}).ok());
  EXPECT_EQ(group.version(), 0);
  EXPECT_EQ(group.stats().pending_contributions, 2);
  EXPECT_EQ(group.stats().step_contributors, (std::vector<int32_t>{0, 2}));
  ASSERT_TRUE(Contribute(group, 0, 1, {100, 200, 300}).ok());
  EXPECT_EQ(group.version(), 1);
  EXPECT_EQ(group.stats().step_contributors, std::vector<int32_t>());
  EXPECT_EQ(Params(group), (std::vector<float>{-111, -222, -333}));  // SGD lr 1, sum
}

// Workers may send anything at padding positions (a whole padded buffer): it never counts
// in the norm, never moves the parameters there, and every path to the reduced gradient
// (one float32 worker's slot, the reduction of several, async application) drops it.
TEST(GroupTest, PaddingGradientNeverReachesNormsOrParameters) {
  // a: flat [0, 3), alignment padding at 3, b: [4, 6); 4 shards of 2: shard 1 is
  // {a[2], padding}, shard 3 is all padding.
  auto layout = FlatLayout::Create({{"a", {3}, DType::kFloat32}, {"b", {2}, DType::kFloat32}}, 4, 4);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->shard_numel(), 2);
  const std::vector<JobSettings> jobs = {
      {.num_workers = 1, .max_grad_norm = 100.0},
      {.num_workers = 2, .reduce_mean = false, .max_grad_norm = 100.0},
  };
  for (const JobSettings& job : jobs) {
    for (int rank : {1, 3}) {
      std::shared_ptr<Group> group = *Group::Create("job", "g", *layout, Placement::Of(rank, 4, 1), job,
                                                    kernels::AdamHyperparams{.lr = 0.1f});
      for (int worker = 0; worker < job.num_workers; ++worker) {
        ASSERT_TRUE(Contribute(*group, 0, worker, {3.0f, 7.0f}).ok());
      }
      const double real = rank == 1 ? 3.0 * job.num_workers : 0.0;  // a[2] only
      EXPECT_EQ(*group->NormPartial(2.0), real * real) << "workers " << job.num_workers << " rank " << rank;
      ASSERT_TRUE(group->FinishClippedStep(0, 1.0f).ok());
      const std::vector<float> params = Params(*group);
      EXPECT_EQ(params[1], 0.0f) << "padding moved";
      EXPECT_EQ(params[0] != 0.0f, rank == 1);
    }
  }
  std::shared_ptr<Group> async = *Group::Create(
      "job", "g", *layout, Placement::Of(1, 4, 1), JobSettings{.num_workers = 2, .async = true}, kernels::SgdHyperparams{.lr = 1.0f});
  ASSERT_TRUE(Contribute(*async, 0, 1, {2.0f, 5.0f}).ok());
  EXPECT_EQ(Params(*async), (std::vector<float>{-1.0f, 0.0f}));  // mean over 2 workers
}

TEST(GroupTest, MeanReductionInRankOrderIsReproducible) {
  // Arrival order must not change a bit: the sum runs in worker-rank order.
  const std::vector<std::vector<float>> grads = {{1e8f, 1, 0.1f}, {1, -1e8f, 0.2f}, {-1e8f, 3, 0.3f}};
  std::vector<float> results[2];
  for (int trial = 0; trial < 2; ++trial) {
    std::shared_ptr<Group> group_owner = MakeGroup(3);
  Group& group = *group_owner;
    const int order[2][3] = {{0, 1, 2}, {2, 0, 1}};
    for (int w : order[trial]) ASSERT_TRUE(Contribute(group, 0, w, grads[w]).ok());
    results[trial] = Params(group);
  }
  EXPECT_EQ(results[0], results[1]);
  const float expected0 = -(((1e8f + 1.0f) + -1e8f) * (1.0f / 3.0f));
  EXPECT_EQ(results[0][0], expected0);
}

// One worker's float32 gradient is the step's gradient: its slot trades places with the
// gradient buffer instead of being copied. Steps in float32 and bfloat16 alternate, and
// a clipped step reads the gradient of its own step, never the previous one.
TEST(GroupTest, OneFloat32WorkerStepsOnItsSlotAlternatingWithBFloat16) {
  std::shared_ptr<Group> group = MakeGroup(1, /*mean=*/true);  // a mean over one: alpha 1
  auto contribute_bf16 = [&](int64_t step, const std::vector<float>& grad) {
    absl::StatusOr<ReceiveSlot> slot = group->BeginScatter(step, 0, DType::kBFloat16);
    ASSERT_TRUE(slot.ok());
    ASSERT_TRUE(kernels::cpu::Cast(DType::kFloat32, grad.data(), DType::kBFloat16, slot->buffer.data(), 3).ok());
    ASSERT_TRUE(group->CommitScatter(*slot).ok());
  };
  ASSERT_TRUE(Contribute(*group, 0, 0, {1, 2, 3}).ok());
  EXPECT_EQ(Params(*group), (std::vector<float>{-1, -2, -3}));  // SGD lr 1
  contribute_bf16(1, {0.5f, 0.25f, 4});
  EXPECT_EQ(Params(*group), (std::vector<float>{-1.5f, -2.25f, -7}));
  ASSERT_TRUE(Contribute(*group, 2, 0, {1, 1, 1}).ok());
  ASSERT_TRUE(Contribute(*group, 3, 0, {2, 0, 0}).ok());
  EXPECT_EQ(Params(*group), (std::vector<float>{-4.5f, -3.25f, -8}));

  auto layout = FlatLayout::Create({{"w", {3}, DType::kFloat32}}, 0, 1);
  std::shared_ptr<Group> clipped = *Group::Create(
      "job", "c", *layout, Placement{}, JobSettings{.num_workers = 1, .max_grad_norm = 1.0}, kernels::SgdHyperparams{.lr = 1.0f});
  ASSERT_TRUE(Contribute(*clipped, 0, 0, {3, 4, 0}).ok());
  EXPECT_EQ(*clipped->NormPartial(2.0), 25.0);
  ASSERT_TRUE(clipped->FinishClippedStep(0, 0.2f).ok());
  ASSERT_TRUE(Contribute(*clipped, 1, 0, {1, 0, 0}).ok());
  EXPECT_EQ(*clipped->NormPartial(2.0), 1.0);
  ASSERT_TRUE(clipped->FinishClippedStep(1, 1.0f).ok());
  EXPECT_EQ(Params(*clipped), (std::vector<float>{-3 * 0.2f - 1, -4 * 0.2f, 0}));
}

TEST(GroupTest, RefusesDuplicateStaleFutureAndInFlight) {
  std::shared_ptr<Group> group_owner = MakeGroup(2);
  Group& group = *group_owner;
  ASSERT_TRUE(Contribute(group, 0, 0, {1, 1, 1}).ok());
  absl::Status duplicate = Contribute(group, 0, 0, {1, 1, 1});
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kAlreadyExists);  // a resend learns it arrived
  EXPECT_THAT(std::string(duplicate.message()), HasSubstr("duplicate contribution"));
  absl::Status future = Contribute(group, 1, 1, {1, 1, 1});
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(future.message()), HasSubstr("future contribution"));
  EXPECT_THAT(std::string(future.message()), HasSubstr("expected step 0"));

  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(0, 1, DType::kBFloat16);
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(slot->buffer.size(), 6u);
  EXPECT_THAT(std::string(group.BeginScatter(0, 1, DType::kFloat32).status().message()),
              HasSubstr("already being received"));
  group.AbortScatter(*slot);  // the transfer died: the worker may send again
  ASSERT_TRUE(Contribute(group, 0, 1, {1, 1, 1}).ok());
  EXPECT_EQ(group.version(), 1);
  absl::Status stale = Contribute(group, 0, 1, {1, 1, 1});
  EXPECT_EQ(stale.code(), absl::StatusCode::kAlreadyExists);  // applied, with this one's
  EXPECT_THAT(std::string(stale.message()), HasSubstr("already applied; expected step 1"));
  EXPECT_EQ(group.BeginScatter(1, 2, DType::kFloat32).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(group.BeginScatter(1, 0, DType::kInt32).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GroupTest, TransfersMustNameTheShardsBytesInTheirDtype) {
  std::shared_ptr<Group> group = MakeGroup(1);
  const uint64_t numel = static_cast<uint64_t>(group->shard_numel());
  EXPECT_TRUE(group->CheckShardBytes(DType::kFloat32, numel * 4, "NCCL").ok());
  EXPECT_TRUE(group->CheckShardBytes(DType::kBFloat16, numel * 2, "NCCL").ok());
  const absl::Status wrong = group->CheckShardBytes(DType::kBFloat16, numel * 4, "CUDA IPC");
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wrong.message(), absl::StrCat("CUDA IPC transfer for group 'g' names ", numel * 4,
                                          " bytes; this server's shard is ", numel * 2, " (", numel,
                                          " bfloat16 elements)"));
}

TEST(GroupTest, GatherWaitsForTheVersionOrTheDeadline) {
  std::shared_ptr<Group> group_owner = MakeGroup(1);
  Group& group = *group_owner;
  absl::StatusOr<GatherSnapshot> late = group.Gather(1, DType::kFloat32, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  std::thread stepper([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(Contribute(group, 0, 0, {1, 2, 3}).ok());
  });
  absl::StatusOr<GatherSnapshot> snapshot = group.Gather(1, DType::kBFloat16, absl::Now() + absl::Seconds(10));
  stepper.join();
  ASSERT_TRUE(snapshot.ok());
  EXPECT_EQ(snapshot->state.version, 1);
  ASSERT_EQ(snapshot->bytes->size(), 6u);
  uint16_t first;
  std::memcpy(&first, snapshot->bytes->data(), 2);
  EXPECT_EQ(first, FloatToBFloat16Bits(-1.0f));
}

// A wait whose caller went away (its call cancelled, its connection closed) ends within
// kCallerCheck of that, Cancelled, rather than at its deadline; the group serves on.
TEST(GroupTest, AWaitEndsOnceItsCallerHasGone) {
  std::shared_ptr<Group> group = MakeGroup(1);
  std::atomic<bool> gone{false};
  const CallerGone caller_gone = [&] { return gone.load(); };
  absl::Status waited, gathered;
  std::thread waiter([&] { waited = group->WaitVersion(1, absl::Now() + absl::Seconds(60), caller_gone).status(); });
  std::thread gatherer(
      [&] { gathered = group->Gather(1, DType::kFloat32, absl::Now() + absl::Seconds(60), caller_gone).status(); });
  absl::SleepFor(absl::Milliseconds(250));  // both wait, asking every 100 ms
  const absl::Time left_at = absl::Now();
  gone = true;
  waiter.join();
  gatherer.join();
  EXPECT_LT(absl::Now() - left_at, absl::Seconds(10)) << "a wait ran to its deadline";
  EXPECT_TRUE(absl::IsCancelled(waited)) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("the caller went away while waiting for version 1"));
  EXPECT_TRUE(absl::IsCancelled(gathered)) << gathered;
  ASSERT_TRUE(Contribute(*group, 0, 0, {1, 2, 3}).ok());
  EXPECT_EQ(group->WaitVersion(1, absl::Now() + absl::Seconds(10), caller_gone).value_or(-1), 1);  // ready first
}

TEST(GroupTest, SeedInitIsIndependentOfServerCountAndPaddingStaysZero) {
  // Tensor values from 1 shard of 1 vs 3 shards of 3.
  std::vector<float> whole;
  {
    std::shared_ptr<Group> one_owner = MakeGroup(1, true, 0, 1);
  Group& one = *one_owner;
    ASSERT_TRUE(one.InitFromSeed(42).ok());
    whole = Params(one);
  }
  std::vector<float> pieces;
  for (int rank = 0; rank < 3; ++rank) {
    std::shared_ptr<Group> part_owner = MakeGroup(1, true, rank, 3);
  Group& part = *part_owner;
    ASSERT_TRUE(part.InitFromSeed(42).ok());
    const std::vector<float> shard = Params(part);
    pieces.insert(pieces.end(), shard.begin(), shard.end());
  }
  pieces.resize(whole.size() + 1);
  EXPECT_EQ(pieces.back(), 0.0f);  // U = 5, N*S = 6: the last element is padding
  pieces.pop_back();
  EXPECT_EQ(pieces, whole);
  for (float v : whole) {
    EXPECT_NE(v, 0.0f);
    EXPECT_LE(std::fabs(v), 1.0f);
  }
  std::shared_ptr<Group> stepped_owner = MakeGroup(1);
  Group& stepped = *stepped_owner;
  ASSERT_TRUE(Contribute(stepped, 0, 0, {1, 1, 1}).ok());
  EXPECT_EQ(stepped.InitFromSeed(1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stepped.BeginPushInit(DType::kFloat32).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Pushed initial values: whatever the sender put at padding positions is dropped, and
// the staging the push came through is freed once it ends (it counts in the group's
// memory only meanwhile).
TEST(GroupTest, PushedInitialValuesDropPaddingAndFreeTheirStaging) {
  // a: flat [0, 3), alignment padding at 3, b: [4, 6); 2 shards of 3: shard 1 is
  // {padding, b[0], b[1]}.
  auto layout = FlatLayout::Create({{"a", {3}, DType::kFloat32}, {"b", {2}, DType::kFloat32}}, 4, 2);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::shared_ptr<Group> group =
      *Group::Create("job", "g", *layout, Placement::Of(1, 2, 1), JobSettings{}, kernels::SgdHyperparams{.lr = 1.0f});
  const int64_t held = group->stats().bytes;
  const int64_t snapshot = 3 * 4;  // the fp32 gather snapshot Params takes
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const int64_t before = group->stats().bytes;
    absl::StatusOr<ReceiveSlot> slot = group->BeginPushInit(dtype);
    ASSERT_TRUE(slot.ok()) << slot.status();
    EXPECT_EQ(group->stats().bytes, before + 3 * static_cast<int64_t>(DTypeSize(dtype)));
    for (int k = 0; k < 3; ++k) {
      const float value = 1.0f + static_cast<float>(k);  // padding (k = 0) too
      if (dtype == DType::kFloat32) {
        std::memcpy(slot->buffer.data() + 4 * k, &value, 4);
      } else {
        const uint16_t bits = static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16);  // exact
        std::memcpy(slot->buffer.data() + 2 * k, &bits, 2);
      }
    }
    ASSERT_TRUE(group->CommitPushInit(*slot).ok());
    EXPECT_EQ(Params(*group), (std::vector<float>{0, 2, 3})) << DTypeName(dtype);
    EXPECT_EQ(group->stats().bytes, held + snapshot) << "the push's staging stayed";
  }
  absl::StatusOr<ReceiveSlot> aborted = group->BeginPushInit(DType::kFloat32);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  group->AbortPushInit(*aborted);
  EXPECT_EQ(group->stats().bytes, held + snapshot);
}

// Deleting a job removes its groups from the registry and closes them: waits that hold
// a group end at once with NotFound, and so does what comes for it later; the name may
// be configured again with other settings.
// The server is shutting down: every group's waits end with the reason (rather than hold
// the shutdown until their deadlines), and later waits and registrations are refused.
TEST(GroupTest, StoppingTheRegistryEndsEveryWaitAndRefusesWhatComesLater) {
  Registry registry(/*rank=*/0, /*num_servers=*/1);
  ASSERT_TRUE(registry.ConfigureJob("job", JobSettings{.num_workers = 2}).ok());
  const std::vector<TensorSpec> tensors = {{"w", {8}, DType::kFloat32}};
  auto registered = registry.RegisterGroup("job", "g", tensors, 0, kernels::SgdHyperparams{.lr = 1.0f});
  ASSERT_TRUE(registered.ok()) << registered.status();
  std::shared_ptr<Group> group = registered->group;
  absl::Status waited, gathered;
  std::thread waiter([&] { waited = group->WaitVersion(1, absl::Now() + absl::Seconds(60)).status(); });
  std::thread gatherer([&] { gathered = group->Gather(1, DType::kFloat32, absl::Now() + absl::Seconds(60)).status(); });
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time stopped_at = absl::Now();
  const absl::Status stopping = absl::UnavailableError("server 0 is shutting down");
  registry.Stop(stopping);
  waiter.join();
  gatherer.join();
  EXPECT_LT(absl::Now() - stopped_at, absl::Seconds(10)) << "the waits ran to their deadline";
  EXPECT_EQ(waited, stopping);
  EXPECT_EQ(gathered, stopping);
  EXPECT_EQ(group->WaitVersion(1, absl::InfiniteFuture()).status(), stopping);
  EXPECT_EQ(group->BeginScatter(0, 0, DType::kFloat32).status(), stopping);
  EXPECT_EQ(registry.RegisterGroup("job", "h", tensors, 0, kernels::SgdHyperparams{.lr = 1.0f}).status(), stopping);
  // A job deleted while the server stops keeps the first reason.
  ASSERT_TRUE(registry.DeleteJob("job").ok());
  EXPECT_EQ(group->WaitVersion(1, absl::InfiniteFuture()).status(), stopping);
}

// A registration of several groups makes all or none: the group that does not fit in
// memory (1 Ti float32, 4 TiB, beyond this machine) takes back those made before it,
// and one registered before stays as it was.
TEST(GroupTest, GroupsRegisteredTogetherAreMadeAllOrNone) {
  Registry registry(/*rank=*/0, /*num_servers=*/1);
  ASSERT_TRUE(registry.ConfigureJob("job", JobSettings{.num_workers = 1}).ok());
  const kernels::SgdHyperparams sgd{.lr = 1.0f};
  auto kept = registry.RegisterGroup("job", "kept", {{"w", {8}, DType::kFloat32}}, 0, sgd);
  ASSERT_TRUE(kept.ok()) << kept.status();
  std::vector<Registry::GroupRequest> groups;
  groups.push_back({"a", {{"w", {8}, DType::kFloat32}}, 0, sgd});
  groups.push_back({"kept", {{"w", {8}, DType::kFloat32}}, 0, sgd});
  groups.push_back({"huge", {{"w", {int64_t{1} << 40}, DType::kFloat32}}, 0, sgd});
  const auto refused = registry.RegisterGroups("job", groups);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("group 'huge'"));
  EXPECT_EQ(registry.FindGroup("job", "a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*registry.FindGroup("job", "kept"), kept->group);

  groups.pop_back();
  const auto made = registry.RegisterGroups("job", groups);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_TRUE((*made)[0].created);
  EXPECT_EQ((*made)[0].group, *registry.FindGroup("job", "a"));
  EXPECT_FALSE((*made)[1].created);
  EXPECT_EQ((*made)[1].group, kept->group);
}

// The small buffers of groups registered together are pieces of shared blocks
// (HostSlab), zero-filled as every group's: those groups, and a large one made in the
// same call (buffers of its own), train bit for bit as groups made one by one, also after
// another call's groups have gone with their job (and their blocks with them).
TEST(GroupTest, GroupsRegisteredTogetherTrainAsGroupsMadeAlone) {
  Registry registry(/*rank=*/0, /*num_servers=*/1);
  ASSERT_TRUE(registry.ConfigureJob("job", JobSettings{.num_workers = 1}).ok());
  ASSERT_TRUE(registry.ConfigureJob("other", JobSettings{.num_workers = 1}).ok());
  const kernels::AdamHyperparams adamw{
      .lr = 0.01f, .weight_decay = 0.1f, .amsgrad = true, .decoupled_weight_decay = true};
  const kernels::SgdHyperparams momentum{.lr = 0.1f, .momentum = 0.9f, .nesterov = true};
  std::vector<Registry::GroupRequest> groups;
  groups.push_back({"adamw", {{"w", {33, 31}, DType::kFloat32}, {"b", {31}, DType::kFloat32}}, 0, adamw});
  groups.push_back({"sgd", {{"w", {257}, DType::kFloat32}}, 0, momentum});
  groups.push_back({"large", {{"w", {300000}, DType::kFloat32}}, 0, adamw});  // 1.2 MB: not carved
  auto others = groups;  // the same specs in a job deleted before the steps
  ASSERT_TRUE(registry.RegisterGroups("other", others).ok());
  const auto made = registry.RegisterGroups("job", groups);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE(registry.DeleteJob("other").ok());
  std::mt19937 random(7);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < groups.size(); ++i) {
    auto layout = FlatLayout::Create(groups[i].tensors, 0, 1);
    std::shared_ptr<Group> alone = *Group::Create("job", groups[i].name, *layout, Placement::Of(0, 1, 1),
                                                  JobSettings{.num_workers = 1}, groups[i].optimizer);
    Group& together = *(*made)[i].group;
    ASSERT_EQ(Params(together), Params(*alone)) << groups[i].name;  // zero, as the optimizer state must be
    std::vector<float> init(alone->shard_numel());
    for (float& v : init) v = normal(random);
    for (Group* group : {&together, alone.get()}) {
      absl::StatusOr<ReceiveSlot> slot = group->BeginPushInit(DType::kFloat32);
      ASSERT_TRUE(slot.ok()) << slot.status();
      std::memcpy(slot->buffer.data(), init.data(), slot->buffer.size());
      ASSERT_TRUE(group->CommitPushInit(*slot).ok());
    }
    for (int64_t step = 0; step < 3; ++step) {
      std::vector<float> grad(alone->shard_numel());
      for (float& v : grad) v = normal(random);
      ASSERT_TRUE(Contribute(together, step, 0, grad).ok());
      ASSERT_TRUE(Contribute(*alone, step, 0, grad).ok());
    }
    const std::vector<float> a = Params(together), b = Params(*alone);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << groups[i].name;
  }
}

// This process's resident memory, from /proc/self/statm.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// Groups registered one by one take their own buffers, not a block each: 512 tiny groups
// (32 bytes a buffer) stay within a few MiB, where a 64 KiB block each would take 32 MiB.
TEST(GroupTest, GroupsRegisteredOneByOneTakeNoBlockEach) {
  Registry registry(/*rank=*/0, /*num_servers=*/1);
  ASSERT_TRUE(registry.ConfigureJob("job", JobSettings{.num_workers = 1}).ok());
  const kernels::AdamHyperparams adam{};
  const int64_t before = ResidentBytes();
  for (int g = 0; g < 512; ++g) {
    ASSERT_TRUE(registry.RegisterGroup("job", absl::StrCat("g", g), {{"w", {8}, DType::kFloat32}}, 0, adam).ok());
  }
  EXPECT_LT(ResidentBytes() - before, int64_t{8} << 20);
}

TEST(GroupTest, DeletingAJobClosesItsGroupsAndEndsTheirWaits) {
  Registry registry(/*rank=*/0, /*num_servers=*/1);
  // Clipped: its step waits for the global norm once the contribution is in.
  ASSERT_TRUE(registry.ConfigureJob("job", JobSettings{.num_workers = 1, .max_grad_norm = 1.0}).ok());
  ASSERT_TRUE(registry.ConfigureJob("other", JobSettings{.num_workers = 1}).ok());
  const std::vector<TensorSpec> tensors = {{"w", {8}, DType::kFloat32}};
  auto registered = registry.RegisterGroup("job", "g", tensors, 0, kernels::SgdHyperparams{.lr = 1.0f});
  ASSERT_TRUE(registered.ok()) << registered.status();
  ASSERT_TRUE(registry.RegisterGroup("other", "g", tensors, 0, kernels::SgdHyperparams{.lr = 1.0f}).ok());
  std::shared_ptr<Group> group = registered->group;
  ASSERT_TRUE(Contribute(*group, 0, 0, std::vector<float>(8, 1.0f)).ok());

  // A worker waiting for version 1 and one sending step 1 early: the norm never comes.
  absl::Status waited, early;
  std::thread waiter([&] { waited = group->WaitVersion(1, absl::Now() + absl::Seconds(60)).status(); });
  std::thread early_waiter([&] { early = group->AwaitEarlyStep(1, absl::Now() + absl::Seconds(60)).status(); });
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time deleted_at = absl::Now();
  absl::StatusOr<std::vector<std::shared_ptr<Group>>> removed = registry.DeleteJob("job");
  ASSERT_TRUE(removed.ok()) << removed.status();
  ASSERT_EQ(removed->size(), 1u);
  EXPECT_EQ(removed->front(), group);
  waiter.join();
  early_waiter.join();
  EXPECT_LT(absl::Now() - deleted_at, absl::Seconds(10)) << "the waits ran to their deadline";
  EXPECT_EQ(waited.code(), absl::StatusCode::kNotFound) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("job 'job' was deleted, and group 'g' with it"));
  EXPECT_EQ(early.code(), absl::StatusCode::kNotFound) << early;

  // What comes later for the group held from before is refused too.
  EXPECT_EQ(group->BeginScatter(1, 0, DType::kFloat32).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(group->Gather(0, DType::kFloat32, absl::InfiniteFuture()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.FindGroup("job", "g").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.DeleteJob("job").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(registry.job_settings("job").ok());
  ASSERT_TRUE(registry.FindGroup("other", "g").ok()) << "another job's group went too";

  // The name is free again, with other settings, and its groups start afresh.
  ASSERT_TRUE(registry.ConfigureJob("job", JobSettings{.num_workers = 3}).ok());
  auto again = registry.RegisterGroup("job", "g", tensors, 0, kernels::SgdHyperparams{.lr = 1.0f});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->created);
  EXPECT_EQ(again->group->version(), 0);
}

TEST(GroupTest, APinHoldsTheVersionUntilUnpinnedWithoutACopy) {
  std::shared_ptr<Group> group_owner = MakeGroup(1, /*mean=*/false);
  Group& group = *group_owner;
  ASSERT_TRUE(group.InitFromSeed(3).ok());
  const std::vector<float> initial = Params(group);
  absl::StatusOr<ShardSnapshot> pinned = group.Pin(0, absl::InfiniteFuture());
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_TRUE(pinned->params.empty());  // metadata only
  std::thread step([&] { EXPECT_TRUE(Contribute(group, 0, 0, {1, 1, 1}).ok()); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(group.version(), 0);  // the step waits for the pin
  std::vector<float> read(group.shard_numel());
  ASSERT_TRUE(group.ReadPinned("", 0, group.shard_numel(), read.data()).ok());
  EXPECT_EQ(read, initial);
  EXPECT_EQ(group.ReadPinned("", 1, group.shard_numel(), read.data()).code(), absl::StatusCode::kOutOfRange);
  group.Unpin();
  step.join();
  EXPECT_EQ(group.version(), 1);
  EXPECT_EQ(group.Pin(0, absl::InfiniteFuture()).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A save's cut holds each group before pinning it: the step that would leave the held
// version waits (the one that reaches it does not), so a pin that comes later still
// finds the group there.
TEST(GroupTest, AHoldKeepsTheGroupAtItsVersionForALaterPin) {
  std::shared_ptr<Group> group_owner = MakeGroup(1, /*mean=*/false);
  Group& group = *group_owner;
  group.HoldAt(1);
  ASSERT_TRUE(Contribute(group, 0, 0, {1, 1, 1}).ok());
  EXPECT_EQ(group.version(), 1);
  std::thread step([&] { EXPECT_TRUE(Contribute(group, 1, 0, {1, 1, 1}).ok()); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(group.version(), 1);  // the step leaving version 1 waits for the hold
  absl::StatusOr<ShardSnapshot> pinned = group.Pin(1, absl::InfiniteFuture());
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  group.ReleaseHold(1);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(group.version(), 1);  // now the pin holds it
  group.Unpin();
  step.join();
  EXPECT_EQ(group.version(), 2);

  group.HoldAt(5);  // a hold at another version holds nothing now
  ASSERT_TRUE(Contribute(group, 2, 0, {1, 1, 1}).ok());
  EXPECT_EQ(group.version(), 3);
  group.ReleaseHold(5);
}

// A checkpoint load installs host buffers; the host tier adopts them. The group serves
// the loaded values at the loaded version and steps on from them; a wrong size is refused
// and changes nothing.
TEST(GroupTest, RestoreInstallsALoadedShard) {
  std::shared_ptr<Group> group_owner = MakeGroup(1, /*mean=*/false);
  Group& group = *group_owner;
  ASSERT_TRUE(group.InitFromSeed(3).ok());
  auto buffer = [](std::vector<float> values) {
    absl::StatusOr<ShardBuffer> out = AllocateHostUnwritten(values.size() * sizeof(float), "test");
    EXPECT_TRUE(out.ok()) << out.status();
    std::copy(values.begin(), values.end(), out->floats());
    return *std::move(out);
  };
  LoadedShard wrong;
  wrong.version = 9;
  wrong.params = buffer({1, 2});
  EXPECT_EQ(group.Restore(std::move(wrong), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(group.version(), 0);

  LoadedShard loaded;
  loaded.version = 7;
  loaded.params = buffer({4, 5, 6});
  ASSERT_TRUE(group.Restore(std::move(loaded), 1).ok());
  EXPECT_EQ(group.version(), 7);
  EXPECT_EQ(Params(group), (std::vector<float>{4, 5, 6}));
  ASSERT_TRUE(Contribute(group, 7, 0, {1, 1, 1}).ok());  // SGD lr 1
  EXPECT_EQ(Params(group), (std::vector<float>{3, 4, 5}));
}

// A gradient names the checkpoint load of the parameters it was computed from: one of
// the state a load replaced is refused, even at the version the load installed, so that
// it never counts for the loaded state. Gathers and state() name the load they read.
TEST(GroupTest, AGradientOfTheStateALoadReplacedIsRefused) {
  std::shared_ptr<Group> group_owner = MakeGroup(1, /*mean=*/false);
  Group& group = *group_owner;
  ASSERT_TRUE(group.InitFromSeed(3).ok());
  const std::vector<float> params = Params(group);
  absl::StatusOr<GatherSnapshot> before = group.Gather(0, DType::kFloat32, absl::InfiniteFuture());
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->state.load_id, 0u);
  absl::StatusOr<ShardBuffer> values = AllocateHostUnwritten(params.size() * sizeof(float), "test");
  ASSERT_TRUE(values.ok()) << values.status();
  std::copy(params.begin(), params.end(), values->floats());
  LoadedShard loaded;
  loaded.params = *std::move(values);  // the same version and values, of another load
  ASSERT_TRUE(group.Restore(std::move(loaded), 0x5eed).ok());
  EXPECT_EQ(group.state().load_id, 0x5eedu);
  EXPECT_EQ(group.state().version, 0);
  absl::StatusOr<GatherSnapshot> after = group.Gather(0, DType::kBFloat16, absl::InfiniteFuture());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->state.load_id, 0x5eedu);

  absl::StatusOr<ReceiveSlot> replaced = group.BeginScatter(0, 0, DType::kFloat32, SlotMemory::kHost, {}, 0);
  EXPECT_EQ(replaced.status().code(), absl::StatusCode::kAborted) << replaced.status();
  EXPECT_THAT(replaced.status().message(),
              HasSubstr("worker 0's gradient for step 0 of group 'g' was computed from the state from before any "
                        "checkpoint load; the group now holds the state of checkpoint load 5eed at version 0"));
  EXPECT_EQ(group.version(), 0);

  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(0, 0, DType::kFloat32, SlotMemory::kHost, {}, 0x5eed);
  ASSERT_TRUE(slot.ok()) << slot.status();
  group.AbortScatter(*slot);
  ASSERT_TRUE(Contribute(group, 0, 0, {1, 1, 1}).ok()) << "a gradient that names no load is not checked";
  EXPECT_EQ(group.state().version, 1);
}

// A load that moves the group below the version a gather or a cut waits for ends the
// wait at once: it dropped the gradients sent for the step in progress, so that version
// comes only once they are sent again. A load at or past the version meets it.
TEST(GroupTest, ALoadBelowTheAwaitedVersionEndsTheWaitAtOnce) {
  std::shared_ptr<Group> group_owner = MakeGroup(2, /*mean=*/false);
  Group& group = *group_owner;
  uint64_t loads = 0;
  auto load = [&](int64_t version) {
    LoadedShard loaded;
    loaded.version = version;
    absl::StatusOr<ShardBuffer> params = AllocateHostUnwritten(3 * sizeof(float), "test");
    ASSERT_TRUE(params.ok()) << params.status();
    std::fill_n(params->floats(), 3, 4.0f);
    loaded.params = *std::move(params);
    ASSERT_TRUE(group.Restore(std::move(loaded), ++loads).ok());
  };
  ASSERT_TRUE(Contribute(group, 0, 0, {1, 2, 3}).ok());  // worker 1's is still to come
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::StatusOr<int64_t> waited;
  absl::StatusOr<GatherSnapshot> gathered;
  absl::StatusOr<ShardSnapshot> cut;
  std::atomic<int> done = 0;
  std::vector<std::thread> waiters;
  waiters.emplace_back([&] { waited = group.WaitVersion(1, deadline), ++done; });
  waiters.emplace_back([&] { gathered = group.Gather(1, DType::kFloat32, deadline), ++done; });
  waiters.emplace_back([&] { cut = group.Snapshot(1, deadline), ++done; });
  // A load before a waiter waits does not end its wait; the next one does.
  for (int loads = 0; loads < 100 && done < 3; ++loads) {
    absl::SleepFor(absl::Milliseconds(20));
    load(0);
  }
  for (std::thread& waiter : waiters) waiter.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kAborted) << waited.status();
  EXPECT_THAT(waited.status().message(),
              HasSubstr("group 'g' was loaded from a checkpoint at version 0 while waiting for version 1"));
  EXPECT_EQ(gathered.status().code(), absl::StatusCode::kAborted) << gathered.status();
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kFailedPrecondition) << cut.status();
  EXPECT_THAT(cut.status().message(), HasSubstr("while waiting for the cut's version 1"));

  EXPECT_EQ(group.stats().step_contributors, std::vector<int32_t>());  // worker 0's gradient went with the load
  const absl::Status ahead = Contribute(group, 1, 1, {1, 1, 1});  // a worker that missed the load
  EXPECT_EQ(ahead.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ahead.message(), HasSubstr("if one moved it back, gather version 0 and train on from there"));
  ASSERT_TRUE(Contribute(group, 0, 1, {1, 1, 1}).ok());
  EXPECT_EQ(group.version(), 0);
  ASSERT_TRUE(Contribute(group, 0, 0, {1, 1, 1}).ok());
  EXPECT_EQ(Params(group), (std::vector<float>{2, 2, 2}));  // SGD lr 1, sum, from 4

  std::thread past([&] { waited = group.WaitVersion(3, deadline); });
  absl::SleepFor(absl::Milliseconds(20));
  load(5);
  past.join();
  EXPECT_EQ(waited.value_or(-1), 5);
  const absl::Status behind = Contribute(group, 1, 0, {1, 1, 1});  // a worker that missed the load
  EXPECT_EQ(behind.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(behind.message(), HasSubstr("if one moved it past this step, gather version 5"));
}

std::shared_ptr<Group> MakeAsyncGroup(int workers, int64_t max_staleness) {
  auto layout = FlatLayout::Create({{"w", {2}, DType::kFloat32}}, 0, 1);
  return *Group::Create("job", "g", *layout, Placement{},
               JobSettings{.num_workers = workers, .reduce_mean = false, .async = true,
                           .max_staleness = max_staleness},
               kernels::SgdHyperparams{.lr = 1.0f});
}

TEST(GroupAsyncTest, EachContributionStepsOnArrival) {
  std::shared_ptr<Group> group_owner = MakeAsyncGroup(2, /*max_staleness=*/1);
  Group& group = *group_owner;
  ASSERT_TRUE(Contribute(group, 0, 1, {1, 2}).ok());
  EXPECT_EQ(group.version(), 1);
  ASSERT_TRUE(Contribute(group, 0, 0, {10, 20}).ok());  // one version old: within the bound
  EXPECT_EQ(group.version(), 2);
  EXPECT_EQ(Params(group), (std::vector<float>{-11, -22}));

  absl::Status stale = Contribute(group, 0, 1, {1, 1});  // worker 1 again, from version 0
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()), HasSubstr("2 versions old; the bound is 1"));
  ASSERT_TRUE(Contribute(group, 1, 1, {1, 1}).ok());  // from version 1: newer than its last
  absl::Status future = Contribute(group, 9, 0, {1, 1});
  EXPECT_THAT(std::string(future.message()), HasSubstr("future contribution"));
}

TEST(GroupAsyncTest, UnboundedStalenessAcceptsOldGradients) {
  std::shared_ptr<Group> group_owner = MakeAsyncGroup(2, /*max_staleness=*/-1);
  Group& group = *group_owner;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Contribute(group, i, 0, {1, 1}).ok());
  ASSERT_TRUE(Contribute(group, 0, 1, {1, 1}).ok());  // five versions old
  EXPECT_EQ(group.version(), 6);
  absl::Status again = Contribute(group, 3, 0, {1, 1});  // a resend of one applied
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.message()), HasSubstr("already contributed from version 4"));
}

TEST(GroupTest, HyperparametersChangeFromTheNextStepAndTheKindCannot) {
  std::shared_ptr<Group> group_owner = MakeGroup(1, /*mean=*/false);
  Group& group = *group_owner;  // SGD lr 1
  ASSERT_TRUE(Contribute(group, 0, 0, {1, 1, 1}).ok());
  ASSERT_TRUE(group.SetOptimizer(kernels::SgdHyperparams{.lr = 0.25f}).ok());
  ASSERT_TRUE(Contribute(group, 1, 0, {1, 1, 1}).ok());
  EXPECT_EQ(Params(group), (std::vector<float>{-1.25f, -1.25f, -1.25f}));
  absl::Status other_kind = group.SetOptimizer(kernels::AdamHyperparams{});
  EXPECT_EQ(other_kind.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other_kind.message()), HasSubstr("cannot switch to adam"));
  EXPECT_EQ(group.SetOptimizer(kernels::SgdHyperparams{.lr = -1.0f}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GroupTest, AFrozenGroupHoldsParametersOnlyAndRefusesGradients) {
  auto layout = FlatLayout::Create({{"w", {3}, DType::kFloat32}, {"b", {2}, DType::kFloat32}}, 0, 2);
  std::shared_ptr<Group> group =
      *Group::Create("job", "frozen", *layout, Placement{}, JobSettings{.num_workers = 2}, Frozen{});
  EXPECT_TRUE(group->frozen());
  EXPECT_EQ(group->optimizer_name(), "frozen");
  // Parameters only: no gradient buffer, no optimizer state.
  EXPECT_EQ(group->stats().bytes, static_cast<int64_t>(group->shard_numel() * sizeof(float)));
  ASSERT_TRUE(group->InitFromSeed(5).ok());
  const std::vector<float> initial = Params(*group);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    absl::StatusOr<ReceiveSlot> slot = group->BeginScatter(0, 0, dtype);
    EXPECT_TRUE(absl::IsFailedPrecondition(slot.status())) << slot.status();
    EXPECT_THAT(std::string(slot.status().message()),
                HasSubstr("group 'frozen' of job 'job' is frozen (registered without an optimizer): it takes no "
                          "gradients"));
  }
  EXPECT_EQ(group->version(), 0);
  EXPECT_EQ(Params(*group), initial);
  EXPECT_FALSE(MakeGroup(1)->frozen());
}

// Module buffers: each step's values are the workers' mean of what they sent, in a SUM job
// too, with no optimizer state; the values are exact for one worker (a copy).
TEST(GroupTest, AnAverageGroupTakesTheWorkersMeanAsItsValues) {
  auto layout = FlatLayout::Create({{"running_mean", {3}, DType::kFloat32}}, 0, 1);
  for (const bool mean : {false, true}) {
    std::shared_ptr<Group> group =
        *Group::Create("job", "buffers", *layout, Placement{}, JobSettings{.num_workers = 2, .reduce_mean = mean},
                       Average{});
    EXPECT_EQ(group->optimizer_name(), "average");
    EXPECT_FALSE(group->in_norm());
    // Parameters and the reduced gradient: no optimizer state.
    EXPECT_EQ(group->stats().bytes, static_cast<int64_t>(2 * group->shard_numel() * sizeof(float)));
    ASSERT_TRUE(Contribute(*group, 0, 1, {1, 2, 3}).ok());
    ASSERT_TRUE(Contribute(*group, 0, 0, {3, 6, -3}).ok());
    EXPECT_EQ(group->version(), 1);
    EXPECT_EQ(Params(*group), (std::vector<float>{2, 4, 0})) << "reduce_mean " << mean;
    ASSERT_TRUE(Contribute(*group, 1, 0, {0.1f, 1e30f, 7}).ok());
    ASSERT_TRUE(Contribute(*group, 1, 1, {0.1f, 1e30f, 7}).ok());
    EXPECT_EQ(Params(*group), (std::vector<float>{0.1f, 1e30f, 7}));  // not the old values' blend
  }
  std::shared_ptr<Group> one =
      *Group::Create("job", "buffers", *layout, Placement{}, JobSettings{.num_workers = 1}, Average{});
  const std::vector<float> values = {0.3f, -1.7e-20f, 123456.789f};
  ASSERT_TRUE(Contribute(*one, 0, 0, values).ok());
  EXPECT_EQ(Params(*one), values);
  EXPECT_TRUE(MakeGroup(1)->in_norm());
}

TEST(GroupTest, AnAverageGroupNeedsASyncJob) {
  auto layout = FlatLayout::Create({{"running_mean", {3}, DType::kFloat32}}, 0, 1);
  absl::StatusOr<std::shared_ptr<Group>> group = Group::Create(
      "job", "buffers", *layout, Placement{}, JobSettings{.num_workers = 2, .async = true}, Average{});
  EXPECT_TRUE(absl::IsInvalidArgument(group.status())) << group.status();
  EXPECT_THAT(std::string(group.status().message()),
              HasSubstr("group 'buffers': optimizer average (module buffers) needs a SYNC job; job 'job' is ASYNC"));
}

}  // namespace
}  // namespace flatshard::server
