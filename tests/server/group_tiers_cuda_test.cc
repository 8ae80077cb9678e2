// The pinned and device memory tiers against the host tier: the same group driven
// through the same steps (several workers, mixed dtypes, clipping, async, init,
// snapshot and restore, hybrid sharding's partials) ends bit for bit equal, since every
// tier runs the same element code. Registration beyond the device's memory is ResourceExhausted naming the group
// and the bytes. Skips, with the reason, without a CUDA device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "kernels/cpu/cast.h"
#include "kernels/cuda/device.h"
#include "server/group.h"
#include "tests/server/replica_partials.h"

namespace flatshard::server {
namespace {

class GroupTiersTest : public ::testing::TestWithParam<MemoryTier> {
 protected:
  void SetUp() override {
    absl::StatusOr<int> count = kernels::cuda::DeviceCount();
    ASSERT_TRUE(count.ok()) << count.status();
    if (*count == 0) GTEST_SKIP() << "no CUDA device (or no driver) on this machine";
  }
};

FlatLayout TestLayout() {
  // Sizes that do not divide evenly; 2 shards, this server holds shard 1.
  return *FlatLayout::Create({{"w", {37, 29}, DType::kFloat32},
                              {"b", {37}, DType::kBFloat16},
                              {"h", {1001}, DType::kFloat32}},
                             0, 2);
}

std::vector<std::byte> RandomGradient(std::mt19937& rng, int64_t n, DType dtype) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> values(n);
  for (float& x : values) x = normal(rng);
  std::vector<std::byte> bytes(n * DTypeSize(dtype));
  EXPECT_TRUE(kernels::cpu::Cast(DType::kFloat32, values.data(), dtype, bytes.data(), n).ok());
  return bytes;
}

// Runs a fixed script on a fresh group of `tier` and returns what a worker and a
// checkpoint would see: gathered fp32 and bf16 bytes, then the snapshot.
struct Outcome {
  std::vector<std::byte> fp32, bf16;
  ShardSnapshot snapshot;
};
Outcome Observe(Group& group);

Outcome RunScript(MemoryTier tier, const JobSettings& job, const OptimizerConfig& optimizer,
                  unsigned seed) {
  absl::StatusOr<std::shared_ptr<Group>> created =
      Group::Create("job", "g", TestLayout(), Placement{.shards = 2, .shard = 1}, job, optimizer, tier);
  EXPECT_TRUE(created.ok()) << created.status();
  Group& group = **created;
  EXPECT_EQ(group.memory_tier(), tier);
  EXPECT_TRUE(group.InitFromSeed(7).ok());
  std::mt19937 rng(seed);
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int64_t step = 0; step < 6; ++step) {
    for (int worker = 0; worker < job.num_workers; ++worker) {
      const DType dtype = dtypes[(worker + step) % 3];
      absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(job.async ? group.version() : step, worker, dtype);
      EXPECT_TRUE(slot.ok()) << slot.status();
      const std::vector<std::byte> grad = RandomGradient(rng, group.shard_numel(), dtype);
      std::memcpy(slot->buffer.data(), grad.data(), grad.size());
      absl::StatusOr<CommitOutcome> outcome = group.CommitScatter(*slot);
      EXPECT_TRUE(outcome.ok()) << outcome.status();
      if (*outcome == CommitOutcome::kReduced) {
        absl::StatusOr<double> partial = group.NormPartial(job.norm_type);
        EXPECT_TRUE(partial.ok()) << partial.status();
        // A clip coefficient that depends on the partial, computed on the host.
        const float coef = static_cast<float>(0.01 / (std::sqrt(*partial) + 1e-6));
        EXPECT_TRUE(group.FinishClippedStep(step, coef).ok());
      }
    }
  }
  return Observe(group);
}

// What a worker and a checkpoint see of `group`: gathered fp32 and bf16 bytes, then the
// snapshot.
Outcome Observe(Group& group) {
  Outcome outcome;
  for (auto [dtype, out] : {std::pair{DType::kFloat32, &outcome.fp32}, std::pair{DType::kBFloat16, &outcome.bf16}}) {
    absl::StatusOr<GatherSnapshot> gathered = group.Gather(0, dtype, absl::InfiniteFuture());
    EXPECT_TRUE(gathered.ok()) << gathered.status();
    const absl::Span<std::byte> bytes = gathered->bytes->bytes();
    out->assign(bytes.begin(), bytes.end());
  }
  absl::StatusOr<ShardSnapshot> snapshot = group.Snapshot(group.version(), absl::InfiniteFuture());
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  outcome.snapshot = *std::move(snapshot);
  return outcome;
}

void ExpectSameOutcome(const Outcome& tier, const Outcome& host) {
  EXPECT_EQ(tier.fp32, host.fp32);
  EXPECT_EQ(tier.bf16, host.bf16);
  EXPECT_EQ(tier.snapshot.version, host.snapshot.version);
  EXPECT_EQ(tier.snapshot.optimizer_steps, host.snapshot.optimizer_steps);
  ASSERT_EQ(tier.snapshot.params.size(), host.snapshot.params.size());
  EXPECT_EQ(std::memcmp(tier.snapshot.params.data(), host.snapshot.params.data(),
                        host.snapshot.params.size() * sizeof(float)), 0);
  ASSERT_EQ(tier.snapshot.state.size(), host.snapshot.state.size());
  for (size_t i = 0; i < host.snapshot.state.size(); ++i) {
    EXPECT_EQ(tier.snapshot.state[i].first, host.snapshot.state[i].first);
    EXPECT_EQ(std::memcmp(tier.snapshot.state[i].second.data(), host.snapshot.state[i].second.data(),
                          host.snapshot.state[i].second.size() * sizeof(float)), 0)
        << host.snapshot.state[i].first;
  }
}

TEST_P(GroupTiersTest, SyncAdamWWithThreeWorkersEqualsTheHostTier) {
  const JobSettings job{.num_workers = 3, .reduce_mean = true};
  const OptimizerConfig adamw = kernels::AdamHyperparams{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled_weight_decay = true};
  ExpectSameOutcome(RunScript(GetParam(), job, adamw, 5), RunScript(MemoryTier::kHost, job, adamw, 5));
}

TEST_P(GroupTiersTest, ClippedAmsgradEqualsTheHostTier) {
  const JobSettings job{.num_workers = 2, .reduce_mean = true, .max_grad_norm = 0.5};
  const OptimizerConfig adam = kernels::AdamHyperparams{.lr = 1e-2f, .weight_decay = 0.1f, .amsgrad = true};
  ExpectSameOutcome(RunScript(GetParam(), job, adam, 6), RunScript(MemoryTier::kHost, job, adam, 6));
}

TEST_P(GroupTiersTest, AsyncNesterovSgdEqualsTheHostTier) {
  const JobSettings job{.num_workers = 2, .reduce_mean = true, .async = true, .max_staleness = 4};
  const OptimizerConfig sgd = kernels::SgdHyperparams{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 1e-3f, .nesterov = true};
  ExpectSameOutcome(RunScript(GetParam(), job, sgd, 7), RunScript(MemoryTier::kHost, job, sgd, 7));
}

// Hybrid sharding: shard 1 in replica groups 0 and 1 of a 4-server cluster, 4 workers in
// mixed dtypes; the exchange goes from group to group by hand. Both replica groups end
// equal, and equal to the host tier's.
Outcome RunHybridScript(MemoryTier tier, unsigned seed) {
  const JobSettings job{.num_workers = 4, .replicas = 2};
  const OptimizerConfig adamw = kernels::AdamHyperparams{.lr = 1e-2f, .weight_decay = 0.01f, .decoupled_weight_decay = true};
  std::shared_ptr<Group> groups[2];
  for (int replica = 0; replica < 2; ++replica) {
    absl::StatusOr<std::shared_ptr<Group>> created =
        Group::Create("job", "g", TestLayout(), Placement::Of(2 * replica + 1, 4, 2), job, adamw, tier);
    EXPECT_TRUE(created.ok()) << created.status();
    groups[replica] = *created;
    EXPECT_TRUE(groups[replica]->InitFromSeed(7).ok());
  }
  std::mt19937 rng(seed);
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int64_t step = 0; step < 4; ++step) {
    for (int worker = 0; worker < job.num_workers; ++worker) {
      Group& group = *groups[job.WorkerReplica(worker)];
      const DType dtype = dtypes[(worker + step) % 3];
      absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker, dtype);
      EXPECT_TRUE(slot.ok()) << slot.status();
      const std::vector<std::byte> grad = RandomGradient(rng, group.shard_numel(), dtype);
      std::memcpy(slot->buffer.data(), grad.data(), grad.size());
      absl::StatusOr<CommitOutcome> outcome = group.CommitScatter(*slot);
      EXPECT_TRUE(outcome.ok()) << outcome.status();
    }
    Group* const replicas[] = {groups[0].get(), groups[1].get()};  // both partials are summed
    absl::StatusOr<std::vector<CommitOutcome>> exchanged = testing::ExchangeAll(replicas, step);
    EXPECT_TRUE(exchanged.ok()) << exchanged.status();
  }
  Outcome first = Observe(*groups[0]);
  ExpectSameOutcome(Observe(*groups[1]), first);
  EXPECT_EQ(first.snapshot.version, 4);
  return first;
}

TEST_P(GroupTiersTest, HybridPartialsEqualTheHostTier) {
  ExpectSameOutcome(RunHybridScript(GetParam(), 9), RunHybridScript(MemoryTier::kHost, 9));
}

// A checkpoint load's host buffers (server/shard_compute.h), filled from `values`.
ShardBuffer LoadBuffer(const HostFloats& values) {
  absl::StatusOr<ShardBuffer> buffer = AllocateHostUnwritten(values.size() * sizeof(float), "test");
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  std::copy(values.begin(), values.end(), buffer->floats());
  return *std::move(buffer);
}

TEST_P(GroupTiersTest, RestoreMovesALoadedShardIntoTheTier) {
  const JobSettings job{.num_workers = 1};
  const OptimizerConfig adam = kernels::AdamHyperparams{.lr = 1e-2f};
  const Outcome host = RunScript(MemoryTier::kHost, job, adam, 8);
  absl::StatusOr<std::shared_ptr<Group>> group = Group::Create("job", "g", TestLayout(), Placement{.shards = 2, .shard = 1}, job, adam, GetParam());
  ASSERT_TRUE(group.ok()) << group.status();
  LoadedShard loaded;
  loaded.version = host.snapshot.version;
  loaded.params = LoadBuffer(host.snapshot.params);
  loaded.optimizer_steps = host.snapshot.optimizer_steps;
  loaded.momentum_initialized = host.snapshot.momentum_initialized;
  for (const auto& [name, values] : host.snapshot.state) loaded.state.emplace_back(name, LoadBuffer(values));
  ASSERT_TRUE((*group)->Restore(std::move(loaded), /*load_id=*/1).ok());
  absl::StatusOr<ShardSnapshot> back = (*group)->Snapshot(host.snapshot.version, absl::InfiniteFuture());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->params, host.snapshot.params);
  ASSERT_EQ(back->state.size(), 2u);
  EXPECT_EQ(back->state[0].second, host.snapshot.state[0].second);
  EXPECT_EQ(back->state[1].second, host.snapshot.state[1].second);
}

TEST_P(GroupTiersTest, RegistrationBeyondMemoryIsResourceExhausted) {
  if (GetParam() == MemoryTier::kPinned) GTEST_SKIP() << "pinned host memory may be overcommitted";
  // 2^36 fp32 elements per shard: 256 GiB for the parameters alone.
  absl::StatusOr<FlatLayout> huge = FlatLayout::Create({{"giant", {int64_t{1} << 37}, DType::kFloat32}}, 0, 2);
  ASSERT_TRUE(huge.ok()) << huge.status();
  absl::StatusOr<std::shared_ptr<Group>> group =
      Group::Create("job", "giant-group", *huge, Placement{}, JobSettings{.num_workers = 1},
                    kernels::AdamHyperparams{}, GetParam());
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), absl::StatusCode::kResourceExhausted) << group.status();
  EXPECT_NE(group.status().message().find("group 'giant-group'"), std::string::npos) << group.status();
  EXPECT_NE(group.status().message().find("274877906944 bytes"), std::string::npos) << group.status();
  // The device still serves smaller groups.
  EXPECT_TRUE(Group::Create("job", "g", TestLayout(), Placement{}, JobSettings{.num_workers = 1},
                            kernels::AdamHyperparams{}, GetParam()).ok());
}

INSTANTIATE_TEST_SUITE_P(GpuTiers, GroupTiersTest,
                         ::testing::Values(MemoryTier::kPinned, MemoryTier::kDevice),
                         [](const auto& info) { return std::string(MemoryTierName(info.param)); });

}  // namespace
}  // namespace flatshard::server
