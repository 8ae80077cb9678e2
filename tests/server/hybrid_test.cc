// Hybrid sharding on one server's side (server/job.h): the job's replica groups in the
// Registry, and a Group's part of the gradient exchange, with the partials carried by
// hand between two Groups that hold the same shard in two replica groups.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "server/group.h"
#include "server/registry.h"
#include "tests/server/replica_partials.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
using testing::DeliverPartial;

std::vector<float> Params(Group& group) {
  absl::StatusOr<GatherSnapshot> snapshot = group.Gather(0, DType::kFloat32, absl::InfiniteFuture());
  std::vector<float> values(group.shard_numel());
  std::memcpy(values.data(), snapshot->bytes->data(), snapshot->bytes->size());
  return values;
}

absl::StatusOr<CommitOutcome> Contribute(Group& group, int64_t step, int worker,
                                         const std::vector<float>& grad) {
  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker, DType::kFloat32);
  if (!slot.ok()) return slot.status();
  std::memcpy(slot->buffer.data(), grad.data(), slot->buffer.size());
  return group.CommitScatter(*slot);
}

struct Replicas {
  std::shared_ptr<Group> group[2];  // the same shard in replica groups 0 and 1
};

// Shard 1 of 2 in each of 2 replica groups (servers 1 and 3 of 4), 4 workers, mean, SGD
// with lr 1 from zero: the parameters are minus the reduced gradient. The shard holds
// elements 5 to 8 of 9, then one element of padding.
Replicas MakeReplicas(int workers = 4) {
  auto layout = FlatLayout::Create({{"w", {9}, DType::kFloat32}}, 0, 2);
  const JobSettings job{.num_workers = workers, .replicas = 2};
  Replicas replicas;
  for (int replica = 0; replica < 2; ++replica) {
    replicas.group[replica] = *Group::Create("job", "g", *layout, Placement::Of(2 * replica + 1, 4, 2), job,
                                             kernels::SgdHyperparams{.lr = 1.0f});
  }
  return replicas;
}

TEST(HybridTest, EveryReplicaAddsThePartialsInReplicaOrderToTheSameBits) {
  Replicas r = MakeReplicas();
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ASSERT_EQ(first.shard_numel(), 5);
  // Magnitudes where the order of fp32 additions changes the result.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<std::vector<float>> grads(4, std::vector<float>(5));
  for (int w = 0; w < 4; ++w) {
    for (float& g : grads[w]) g = unit(rng) * (w % 2 == 0 ? 1e7f : 1.0f);
  }
  // Replica group 0 takes workers 0 and 2, replica group 1 workers 1 and 3.
  EXPECT_EQ(*Contribute(first, 0, 2, grads[2]), CommitOutcome::kPending);
  EXPECT_EQ(*Contribute(first, 0, 0, grads[0]), CommitOutcome::kShare);
  EXPECT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);  // its own are not in
  EXPECT_EQ(*Contribute(second, 0, 1, grads[1]), CommitOutcome::kPending);
  EXPECT_EQ(*Contribute(second, 0, 3, grads[3]), CommitOutcome::kShare);
  EXPECT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);  // its own not shared yet
  EXPECT_EQ(*first.CommitOwnPartial(0), CommitOutcome::kApplied);
  EXPECT_EQ(*second.CommitOwnPartial(0), CommitOutcome::kApplied);
  EXPECT_EQ(first.version(), 1);
  EXPECT_EQ(second.version(), 1);

  const std::vector<float> params = Params(first);
  EXPECT_EQ(params, Params(second)) << "replica groups diverged";
  EXPECT_EQ(params[4], 0.0f) << "padding moved";
  for (int i = 0; i < 4; ++i) {
    // Each replica group's partial in worker-rank order, then the partials in replica
    // order, then the mean: fp32 throughout (bitwise), and within fp32 rounding of the
    // float64 sum.
    const float partial0 = grads[0][i] + grads[2][i];
    const float partial1 = grads[1][i] + grads[3][i];
    EXPECT_EQ(params[i], -((partial0 + partial1) * 0.25f)) << i;
    const double exact = (double{grads[0][i]} + grads[1][i] + grads[2][i] + grads[3][i]) / 4;
    EXPECT_NEAR(params[i], -exact, 1e-6 * 1e7) << i;
  }
}

TEST(HybridTest, RefusesOtherReplicasWorkersAndMisdirectedPartials) {
  Replicas r = MakeReplicas();
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  const std::vector<float> grad(5, 1.0f);
  absl::StatusOr<CommitOutcome> wrong = Contribute(first, 0, 1, grad);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong.status())) << wrong.status();
  EXPECT_THAT(wrong.status().message(), HasSubstr("belongs to replica group 1"));
  EXPECT_TRUE(absl::IsInvalidArgument(first.BeginReplicaPartial(0, 0).status()));  // its own
  EXPECT_TRUE(absl::IsInvalidArgument(first.BeginReplicaPartial(0, 2).status()));  // no such
  EXPECT_TRUE(absl::IsFailedPrecondition(first.BeginReplicaPartial(1, 1).status()));  // future
  EXPECT_TRUE(absl::IsFailedPrecondition(first.SharedPartial(0).status()));  // not summed
  EXPECT_TRUE(absl::IsFailedPrecondition(first.CommitOwnPartial(0).status()));

  // A partial being received is not taken twice; one held or applied is AlreadyExists
  // (a sender whose answer was lost sends it again).
  absl::StatusOr<ReceiveSlot> receiving = second.BeginReplicaPartial(0, 0);
  ASSERT_TRUE(receiving.ok()) << receiving.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(second.BeginReplicaPartial(0, 0).status()));
  second.AbortReplicaPartial(*receiving);
  ASSERT_TRUE(Contribute(first, 0, 0, grad).ok());
  ASSERT_EQ(*Contribute(first, 0, 2, grad), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  EXPECT_TRUE(absl::IsAlreadyExists(DeliverPartial(first, second, 0).status()));
  EXPECT_TRUE(absl::IsAlreadyExists(Contribute(first, 0, 0, grad).status()));  // held
  ASSERT_TRUE(Contribute(second, 0, 1, grad).ok());
  ASSERT_EQ(*Contribute(second, 0, 3, grad), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(0), CommitOutcome::kApplied);
  ASSERT_EQ(*second.CommitOwnPartial(0), CommitOutcome::kApplied);
  EXPECT_TRUE(absl::IsAlreadyExists(second.BeginReplicaPartial(0, 0).status()));  // applied
  EXPECT_EQ(Params(first), (std::vector<float>{-1, -1, -1, -1, 0}));
}

TEST(HybridTest, ALoadDropsPartialsInFlight) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ASSERT_EQ(*Contribute(first, 0, 0, std::vector<float>(5, 8.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  LoadedShard loaded;
  loaded.version = 0;
  loaded.params = *AllocateHostUnwritten(5 * sizeof(float), "test");
  std::fill_n(loaded.params.floats(), 5, 0.0f);
  ASSERT_TRUE(second.Restore(std::move(loaded)).ok());
  // The partial received before the load is gone: it is taken again.
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*Contribute(second, 0, 1, std::vector<float>(5, 2.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(0), CommitOutcome::kApplied);
  ASSERT_EQ(*second.CommitOwnPartial(0), CommitOutcome::kApplied);
  EXPECT_EQ(Params(second), (std::vector<float>{-5, -5, -5, -5, 0}));  // (8 + 2) / 2
  EXPECT_EQ(Params(first), Params(second));
}

TEST(HybridTest, ReplicaGroupsMayHaveDifferentWorkerCounts) {
  Replicas r = MakeReplicas(3);  // replica group 0: workers 0 and 2; 1: worker 1
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  EXPECT_EQ(*Contribute(second, 0, 1, std::vector<float>(5, 6.0f)), CommitOutcome::kShare);
  EXPECT_EQ(*Contribute(first, 0, 0, std::vector<float>(5, 1.0f)), CommitOutcome::kPending);
  EXPECT_EQ(*Contribute(first, 0, 2, std::vector<float>(5, 2.0f)), CommitOutcome::kShare);
  // Each shares its partial before counting it, as StepDriver does.
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*second.CommitOwnPartial(0), CommitOutcome::kApplied);
  ASSERT_EQ(*first.CommitOwnPartial(0), CommitOutcome::kApplied);
  const std::vector<float> expected = {-3, -3, -3, -3, 0};  // the mean over all 3 workers
  EXPECT_EQ(Params(first), expected);
  EXPECT_EQ(Params(second), expected);
}

TEST(HybridTest, RegistryLaysGroupsOutOverOneReplicaGroup) {
  Registry registry(/*rank=*/5, /*num_servers=*/6);
  ASSERT_TRUE(registry.ConfigureJob("hybrid", {.num_workers = 4, .replicas = 3}).ok());
  const Placement placement = *registry.job_placement("hybrid");
  EXPECT_EQ(placement.shards, 2);
  EXPECT_EQ(placement.shard, 1);
  EXPECT_EQ(placement.replica, 2);
  EXPECT_EQ(placement.PeerRank(0), 1);
  auto registered = registry.RegisterGroup("hybrid", "g", {{"w", {7}, DType::kFloat32}}, 0,
                                           kernels::SgdHyperparams{});
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->group->layout().num_shards(), 2);
  EXPECT_EQ(registered->group->shard_numel(), 4);

  ASSERT_TRUE(registry.ConfigureJob("plain", {.num_workers = 1}).ok());
  EXPECT_EQ(registry.job_placement("plain")->shards, 6);
  EXPECT_EQ(registry.job_placement("plain")->shard, 5);

  struct Bad {
    JobSettings settings;
    const char* message;
  };
  for (const Bad& bad : {Bad{{.num_workers = 8, .replicas = 4}, "does not divide"},
                         Bad{{.num_workers = 8, .replicas = 0}, "does not divide"},
                         Bad{{.num_workers = 2, .replicas = 3}, "every replica group needs a worker"},
                         Bad{{.num_workers = 4, .async = true, .replicas = 2}, "sync mode"},
                         Bad{{.num_workers = 4, .async = true, .skip_nonfinite = true}, "sync mode"}}) {
    const absl::Status status = registry.ConfigureJob("bad", bad.settings);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_THAT(status.message(), HasSubstr(bad.message));
  }
  const absl::Status changed = registry.ConfigureJob("hybrid", {.num_workers = 4, .replicas = 2});
  EXPECT_TRUE(absl::IsFailedPrecondition(changed)) << changed;
  EXPECT_THAT(changed.message(), HasSubstr("replicas 3"));
}

}  // namespace
}  // namespace flatshard::server
