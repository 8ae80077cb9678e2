// Hybrid sharding on one server's side (server/job.h): the job's replica groups in the
// Registry, and a Group's part of the gradient exchange, carried by hand between the
// Groups that hold the same shard in two or three replica groups.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "server/clip_coordinator.h"
#include "server/group.h"
#include "server/registry.h"
#include "server/stats.h"
#include "server/step_driver.h"
#include "transport/data_protocol.h"
#include "transport/tcp/tcp_transport.h"
#include "tests/server/replica_partials.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
using testing::DeliverPartial;
using testing::DeliverReduced;

constexpr ExchangeRound kStep0{.step = 0};  // step 0 of a group never loaded

std::vector<float> Params(Group& group) {
  absl::StatusOr<GatherSnapshot> snapshot = group.Gather(0, DType::kFloat32, absl::InfiniteFuture());
  std::vector<float> values(group.shard_numel());
  std::memcpy(values.data(), snapshot->bytes->data(), snapshot->bytes->size());
  return values;
}

// What a StepDriver of server 1 of 4 needs around it (jobs here do not clip), and its
// counters. Outlives the drivers it makes.
struct DriverSetting {
  Registry registry{/*rank=*/1, /*num_servers=*/4};
  ClipCoordinator clip{registry, 1, 4,
                       [](int, const std::string&, int64_t, double, uint64_t) { return absl::OkStatus(); }};
  ServerStats stats;

  std::unique_ptr<StepDriver> Driver(StepDriver::Connect connect, absl::Duration timeout) {
    return std::make_unique<StepDriver>(4, clip, std::move(connect), timeout, stats);
  }
};

absl::StatusOr<CommitOutcome> Contribute(Group& group, int64_t step, int worker,
                                         const std::vector<float>& grad) {
  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker, DType::kFloat32);
  if (!slot.ok()) return slot.status();
  std::memcpy(slot->buffer.data(), grad.data(), slot->buffer.size());
  return group.CommitScatter(*slot);
}

// The broadcast phase of `round` between two replica groups whose chunks are reduced:
// each reduced chunk to the other, then both commit it, which applies the step.
void BroadcastAndApply(Group& first, Group& second, const ExchangeRound& round) {
  ASSERT_EQ(*DeliverReduced(first, second, round.step), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverReduced(second, first, round.step), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitBroadcast(round), CommitOutcome::kApplied);
  ASSERT_EQ(*second.CommitBroadcast(round), CommitOutcome::kApplied);
}

struct Replicas {
  std::shared_ptr<Group> group[3];  // the same shard in each replica group
};

// Shard 1 of 2 in each of `replicas` replica groups (servers 1, 3, 5 of 2R), `workers`
// workers, mean, SGD with lr 1 from zero: the parameters are minus the reduced gradient.
// The shard holds elements 10 to 18 of 19, then one element of padding; replica group
// q's server reduces chunk q of it.
Replicas MakeReplicas(int workers = 4, int replicas = 2, double max_grad_norm = 0) {
  auto layout = FlatLayout::Create({{"w", {19}, DType::kFloat32}}, 0, 2);
  const JobSettings job{.num_workers = workers, .max_grad_norm = max_grad_norm, .replicas = replicas};
  Replicas r;
  for (int replica = 0; replica < replicas; ++replica) {
    r.group[replica] = *Group::Create("job", "g", *layout, Placement::Of(2 * replica + 1, 2 * replicas, replicas),
                                      job, kernels::SgdHyperparams{.lr = 1.0f});
  }
  return r;
}

TEST(HybridTest, TheShardIsCutIntoAlignedChunksOnePerReplicaGroup) {
  Replicas two = MakeReplicas();
  ASSERT_EQ(two.group[0]->shard_numel(), 10);
  EXPECT_EQ(two.group[0]->ReplicaChunk(0), (std::pair<int64_t, int64_t>{0, 4}));
  EXPECT_EQ(two.group[0]->ReplicaChunk(1), (std::pair<int64_t, int64_t>{4, 6}));
  Replicas three = MakeReplicas(3, 3);
  EXPECT_EQ(three.group[2]->ReplicaChunk(0), (std::pair<int64_t, int64_t>{0, 0}));  // 10 / 3 -> 0
  EXPECT_EQ(three.group[2]->ReplicaChunk(1), (std::pair<int64_t, int64_t>{0, 4}));  // 20 / 3 -> 4
  EXPECT_EQ(three.group[2]->ReplicaChunk(2), (std::pair<int64_t, int64_t>{4, 6}));
}

TEST(HybridTest, EveryReplicaAddsThePartialsInReplicaOrderToTheSameBits) {
  Replicas r = MakeReplicas();
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  // Magnitudes where the order of fp32 additions changes the result.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<std::vector<float>> grads(4, std::vector<float>(10));
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
  // Each owner now holds both partials of its chunk: reduced, to be broadcast.
  EXPECT_EQ(*first.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  EXPECT_EQ(*second.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  EXPECT_EQ(*DeliverReduced(first, second, 0), CommitOutcome::kPending);  // its own not broadcast
  EXPECT_EQ(*DeliverReduced(second, first, 0), CommitOutcome::kPending);
  EXPECT_EQ(*first.CommitBroadcast(kStep0), CommitOutcome::kApplied);
  EXPECT_EQ(*second.CommitBroadcast(kStep0), CommitOutcome::kApplied);
  EXPECT_EQ(first.version(), 1);
  EXPECT_EQ(second.version(), 1);

  const std::vector<float> params = Params(first);
  EXPECT_EQ(params, Params(second)) << "replica groups diverged";
  EXPECT_EQ(params[9], 0.0f) << "padding moved";
  for (int i = 0; i < 9; ++i) {
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

// Module buffers across replica groups: the mean of all W workers' values, in a SUM job
// too, the same in every replica group.
TEST(HybridTest, AnAverageGroupTakesTheMeanOfEveryReplicaGroupsWorkers) {
  auto layout = FlatLayout::Create({{"running_mean", {19}, DType::kFloat32}}, 0, 2);
  const JobSettings job{.num_workers = 4, .reduce_mean = false, .replicas = 2};
  std::shared_ptr<Group> groups[2];
  for (int replica = 0; replica < 2; ++replica) {
    groups[replica] = *Group::Create("job", "buffers", *layout, Placement::Of(2 * replica + 1, 4, 2), job, Average{});
  }
  Group& first = *groups[0];
  Group& second = *groups[1];
  std::vector<std::vector<float>> values(4, std::vector<float>(10));
  for (int w = 0; w < 4; ++w) {
    for (int i = 0; i < 10; ++i) values[w][i] = static_cast<float>(w * 10 + i);
  }
  ASSERT_EQ(*Contribute(first, 0, 0, values[0]), CommitOutcome::kPending);
  ASSERT_EQ(*Contribute(first, 0, 2, values[2]), CommitOutcome::kShare);
  ASSERT_EQ(*Contribute(second, 0, 1, values[1]), CommitOutcome::kPending);
  ASSERT_EQ(*Contribute(second, 0, 3, values[3]), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  ASSERT_EQ(*second.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  BroadcastAndApply(first, second, kStep0);
  const std::vector<float> params = Params(first);
  EXPECT_EQ(params, Params(second)) << "replica groups diverged";
  for (int i = 0; i < 9; ++i) EXPECT_EQ(params[i], 15.0f + static_cast<float>(i)) << i;  // (0+10+20+30)/4 + i
  EXPECT_EQ(params[9], 0.0f) << "padding moved";
}

// Three replica groups, one of whose chunks is empty: the same bits as adding the three
// partials of the whole shard in replica order, in every replica group.
TEST(HybridTest, ThreeReplicaGroupsReduceAChunkEachToTheSameBits) {
  Replicas r = MakeReplicas(6, 3);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<std::vector<float>> grads(6, std::vector<float>(10));
  for (int w = 0; w < 6; ++w) {
    for (float& g : grads[w]) g = unit(rng) * (w % 3 == 1 ? 1e7f : 1.0f);
  }
  for (int w = 0; w < 6; ++w) {
    const absl::StatusOr<CommitOutcome> outcome = Contribute(*r.group[w % 3], 0, w, grads[w]);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(*outcome, w < 3 ? CommitOutcome::kPending : CommitOutcome::kShare) << w;
  }
  Group* const groups[] = {r.group[0].get(), r.group[1].get(), r.group[2].get()};
  const absl::StatusOr<std::vector<CommitOutcome>> outcomes = testing::ExchangeAll(groups, 0);
  ASSERT_TRUE(outcomes.ok()) << outcomes.status();
  EXPECT_EQ(*outcomes, std::vector<CommitOutcome>(3, CommitOutcome::kApplied));
  const std::vector<float> params = Params(*r.group[0]);
  EXPECT_EQ(params[9], 0.0f) << "padding moved";
  for (int i = 0; i < 9; ++i) {
    float partials[3];
    for (int q = 0; q < 3; ++q) partials[q] = grads[q][i] + grads[q + 3][i];
    EXPECT_EQ(params[i], -((partials[0] + partials[1] + partials[2]) * (1.0f / 6.0f))) << i;
  }
  EXPECT_EQ(Params(*r.group[1]), params);
  EXPECT_EQ(Params(*r.group[2]), params);
}

TEST(HybridTest, RefusesOtherReplicasWorkersAndMisdirectedExchanges) {
  Replicas r = MakeReplicas();
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  const std::vector<float> grad(10, 1.0f);
  absl::StatusOr<CommitOutcome> wrong = Contribute(first, 0, 1, grad);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong.status())) << wrong.status();
  EXPECT_THAT(wrong.status().message(), HasSubstr("belongs to replica group 1"));
  for (Exchange what : {Exchange::kPartial, Exchange::kReduced}) {
    EXPECT_TRUE(absl::IsInvalidArgument(first.BeginExchange(what, kStep0, 0).status()));          // its own
    EXPECT_TRUE(absl::IsInvalidArgument(first.BeginExchange(what, kStep0, 2).status()));          // no such
    EXPECT_TRUE(absl::IsFailedPrecondition(first.BeginExchange(what, {.step = 1}, 1).status()));  // future
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(first.SharedPartial(0).status()));  // not summed
  EXPECT_TRUE(absl::IsFailedPrecondition(first.CommitOwnPartial(kStep0).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(first.BroadcastChunk(0).status()));  // not reduced
  EXPECT_TRUE(absl::IsFailedPrecondition(first.CommitBroadcast(kStep0).status()));

  // A chunk being received is not taken twice; one held or applied is AlreadyExists (a
  // sender whose answer was lost sends it again).
  absl::StatusOr<ReceiveSlot> receiving = second.BeginExchange(Exchange::kPartial, kStep0, 0);
  ASSERT_TRUE(receiving.ok()) << receiving.status();
  EXPECT_EQ(receiving->buffer.size(), 6 * sizeof(float));  // chunk 1
  EXPECT_TRUE(absl::IsFailedPrecondition(second.BeginExchange(Exchange::kPartial, kStep0, 0).status()));
  second.AbortExchange(Exchange::kPartial, *receiving);
  ASSERT_TRUE(Contribute(first, 0, 0, grad).ok());
  ASSERT_EQ(*Contribute(first, 0, 2, grad), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  EXPECT_TRUE(absl::IsAlreadyExists(DeliverPartial(first, second, 0).status()));
  EXPECT_TRUE(absl::IsAlreadyExists(Contribute(first, 0, 0, grad).status()));  // held
  ASSERT_TRUE(Contribute(second, 0, 1, grad).ok());
  ASSERT_EQ(*Contribute(second, 0, 3, grad), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  ASSERT_EQ(*second.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  ASSERT_EQ(*DeliverReduced(first, second, 0), CommitOutcome::kPending);
  EXPECT_TRUE(absl::IsAlreadyExists(DeliverReduced(first, second, 0).status()));
  ASSERT_EQ(*DeliverReduced(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitBroadcast(kStep0), CommitOutcome::kApplied);
  ASSERT_EQ(*second.CommitBroadcast(kStep0), CommitOutcome::kApplied);
  EXPECT_TRUE(absl::IsAlreadyExists(second.BeginExchange(Exchange::kPartial, kStep0, 0).status()));  // applied
  EXPECT_TRUE(absl::IsAlreadyExists(second.BeginExchange(Exchange::kReduced, kStep0, 0).status()));
  EXPECT_EQ(Params(first), (std::vector<float>{-1, -1, -1, -1, -1, -1, -1, -1, -1, 0}));

  // A frozen group holds no gradient to receive into.
  auto frozen = Group::Create("job", "frozen", first.layout(), first.placement(), {.num_workers = 4, .replicas = 2},
                              Frozen{});
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  for (Exchange what : {Exchange::kPartial, Exchange::kReduced}) {
    const absl::Status refused = (*frozen)->BeginExchange(what, kStep0, 1).status();
    EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
    EXPECT_THAT(refused.message(), HasSubstr("is frozen"));
  }
}

// What a commit hands over to be sent (kShare, kBroadcast) is claimed by one caller at a
// time; after a failed send it is released and claimed again, once.
TEST(HybridTest, ASendThatFailedIsClaimedAgainOnce) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  EXPECT_FALSE(first.ClaimPending(0).has_value());  // nothing summed yet
  ASSERT_EQ(*Contribute(first, 0, 0, std::vector<float>(10, 2.0f)), CommitOutcome::kShare);
  EXPECT_FALSE(first.ClaimPending(0).has_value());  // the commit's caller holds it
  first.ReleasePending(kStep0, CommitOutcome::kShare);
  EXPECT_EQ(first.ClaimPending(0), CommitOutcome::kShare);
  EXPECT_FALSE(first.ClaimPending(0).has_value());
  ASSERT_EQ(*Contribute(second, 0, 1, std::vector<float>(10, 4.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  EXPECT_FALSE(first.ClaimPending(0).has_value());
  first.ReleasePending(kStep0, CommitOutcome::kBroadcast);
  EXPECT_FALSE(first.ClaimPending(1).has_value());  // another step
  EXPECT_EQ(first.ClaimPending(0), CommitOutcome::kBroadcast);
  ASSERT_EQ(*second.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  ASSERT_NO_FATAL_FAILURE(BroadcastAndApply(first, second, kStep0));
  EXPECT_FALSE(first.ClaimPending(1).has_value());
  EXPECT_EQ(Params(first), Params(second));
  EXPECT_EQ(Params(first)[0], -3.0f);  // (2 + 4) / 2
}

// A clipped step waits for the norm with its exchange done: a chunk sent again meanwhile
// (its sender lost the answer) is a duplicate, not the next step's.
TEST(HybridTest, AChunkSentAgainWhileTheNormIsPendingIsADuplicate) {
  Replicas r = MakeReplicas(2, 2, /*max_grad_norm=*/1.0);
  Group* const groups[] = {r.group[0].get(), r.group[1].get()};
  ASSERT_EQ(*Contribute(*groups[0], 0, 0, std::vector<float>(10, 2.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*Contribute(*groups[1], 0, 1, std::vector<float>(10, 4.0f)), CommitOutcome::kShare);
  const absl::StatusOr<std::vector<CommitOutcome>> outcomes = testing::ExchangeAll(groups, 0);
  ASSERT_TRUE(outcomes.ok()) << outcomes.status();
  EXPECT_EQ(*outcomes, std::vector<CommitOutcome>(2, CommitOutcome::kReduced));
  for (Exchange what : {Exchange::kPartial, Exchange::kReduced}) {
    const absl::Status again = groups[1]->BeginExchange(what, kStep0, 0).status();
    EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  }
  ASSERT_TRUE(groups[0]->FinishClippedStep(0, 1.0f).ok());
  ASSERT_TRUE(groups[1]->FinishClippedStep(0, 1.0f).ok());
  // The next step starts from an empty exchange.
  ASSERT_EQ(*Contribute(*groups[0], 1, 0, std::vector<float>(10, 1.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(*groups[0], *groups[1], 1), CommitOutcome::kPending);
}

// Installs zeros at version 0 on `group` as checkpoint load `load_id`.
void LoadZeros(Group& group, uint64_t load_id) {
  LoadedShard loaded;
  loaded.version = 0;
  absl::StatusOr<ShardBuffer> params = AllocateHostUnwritten(10 * sizeof(float), "test");
  ASSERT_TRUE(params.ok()) << params.status();
  std::fill_n(params->floats(), 10, 0.0f);
  loaded.params = *std::move(params);
  ASSERT_TRUE(group.Restore(std::move(loaded), load_id).ok());
}

// A load drops the exchange in flight and starts a new round, even at the same version:
// what belongs to the state it replaced (a partial still on its way, the sender's marks
// and commits) counts for nothing, and the step taken again sums its own gradients only.
TEST(HybridTest, ALoadStartsANewRoundOfTheExchange) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ASSERT_EQ(*Contribute(first, 0, 0, std::vector<float>(10, 8.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  constexpr uint64_t kLoad = 0x5eed;
  LoadZeros(second, kLoad);
  ASSERT_FALSE(HasFatalFailure());
  // Sent again by first, which has not committed the load yet: of the replaced state.
  const absl::Status stale = DeliverPartial(first, second, 0).status();
  EXPECT_TRUE(absl::IsAborted(stale)) << stale;
  EXPECT_THAT(stale.message(), HasSubstr("is of the state from before any checkpoint load, which a checkpoint "
                                         "load replaced here (this server holds the state of checkpoint load 5eed"));
  // From a load second has not committed.
  const absl::Status ahead = second.BeginExchange(Exchange::kPartial, {.step = 0, .load_epoch = 9}, 0).status();
  EXPECT_TRUE(absl::IsUnavailable(ahead)) << ahead;
  EXPECT_THAT(ahead.message(), HasSubstr("is of the state of checkpoint load 9, which this server has not committed"));
  EXPECT_FALSE(second.AwaitLoad(9, absl::Now() + absl::Milliseconds(50)));
  EXPECT_TRUE(second.AwaitLoad(kLoad, absl::Now()));
  EXPECT_TRUE(second.AwaitLoad(0, absl::Now()));  // left since

  LoadZeros(first, kLoad);
  ASSERT_FALSE(HasFatalFailure());
  const ExchangeRound redo{.step = 0, .load_epoch = kLoad};
  ASSERT_EQ(*Contribute(first, 0, 0, std::vector<float>(10, 6.0f)), CommitOutcome::kShare);
  // The old round's sender finishing late: its marks, release and commit are ignored.
  first.MarkDelivered(kStep0, CommitOutcome::kShare, 1);
  EXPECT_FALSE(first.Delivered(redo, CommitOutcome::kShare, 1));
  first.ReleasePending(kStep0, CommitOutcome::kShare);
  EXPECT_FALSE(first.ClaimPending(0).has_value());  // still the new commit's caller's
  EXPECT_TRUE(absl::IsFailedPrecondition(first.CommitOwnPartial(kStep0).status()));
  EXPECT_EQ(first.SharedPartial(0)->round, redo);

  ASSERT_EQ(*Contribute(second, 0, 1, std::vector<float>(10, 2.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(redo), CommitOutcome::kBroadcast);
  ASSERT_EQ(*second.CommitOwnPartial(redo), CommitOutcome::kBroadcast);
  ASSERT_NO_FATAL_FAILURE(BroadcastAndApply(first, second, redo));
  EXPECT_EQ(Params(second), (std::vector<float>{-4, -4, -4, -4, -4, -4, -4, -4, -4, 0}));  // (6 + 2) / 2
  EXPECT_EQ(Params(first), Params(second));
}

TEST(HybridTest, ReplicaGroupsMayHaveDifferentWorkerCounts) {
  Replicas r = MakeReplicas(3);  // replica group 0: workers 0 and 2; 1: worker 1
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  EXPECT_EQ(*Contribute(second, 0, 1, std::vector<float>(10, 6.0f)), CommitOutcome::kShare);
  EXPECT_EQ(*Contribute(first, 0, 0, std::vector<float>(10, 1.0f)), CommitOutcome::kPending);
  EXPECT_EQ(*Contribute(first, 0, 2, std::vector<float>(10, 2.0f)), CommitOutcome::kShare);
  Group* const groups[] = {&first, &second};
  ASSERT_TRUE(testing::ExchangeAll(groups, 0).ok());
  const std::vector<float> expected = {-3, -3, -3, -3, -3, -3, -3, -3, -3, 0};  // the mean over 3 workers
  EXPECT_EQ(Params(first), expected);
  EXPECT_EQ(Params(second), expected);
}

// Workers 0 and 1 of a 2-worker job contribute 2 and 4 to step 0 and the partials are
// exchanged: each server's chunk is reduced and waits to be broadcast (kBroadcast).
void ReduceChunks(Replicas& r) {
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ASSERT_EQ(*Contribute(first, 0, 0, std::vector<float>(10, 2.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*Contribute(second, 0, 1, std::vector<float>(10, 4.0f)), CommitOutcome::kShare);
  ASSERT_EQ(*DeliverPartial(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*first.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
  ASSERT_EQ(*second.CommitOwnPartial(kStep0), CommitOutcome::kBroadcast);
}

// A peer for StepDriver: serves the exchange for `group` on 127.0.0.1, one connection
// at a time, as DataServer does (no hello), with a StepDriver of its own.
class ExchangePeer {
 public:
  explicit ExchangePeer(Group& group)
      : group_(group),
        driver_(
            setting_.Driver([](int) { return absl::UnavailableError("the peer sends nothing"); }, absl::Seconds(10))),
        listener_(*transport::ListenTcp("127.0.0.1", 0)),
        thread_([this] { Serve(); }) {}
  ~ExchangePeer() {
    listener_->Shutdown();
    thread_.join();
  }
  int port() const { return listener_->port(); }

 private:
  void Serve() {
    for (auto conn = listener_->Accept(); conn.ok(); conn = listener_->Accept()) {
      for (auto request = transport::RecvRequest(**conn); request.ok();
           request = transport::RecvRequest(**conn)) {
        const Exchange what = request->op == transport::DataOp::kReplicaPartial ? Exchange::kPartial
                                                                               : Exchange::kReduced;
        absl::StatusOr<ReceiveSlot> slot = driver_->BeginExchange(
            group_, what, {request->version, request->load_id.value_or(0)}, request->worker_rank, request->Deadline());
        absl::Status verdict = slot.status();
        if (!slot.ok()) {
          if (!transport::DrainPayload(**conn, request->payload_bytes).ok()) break;
        } else if ((*conn)->Recv(slot->buffer).ok()) {
          verdict = group_.CommitExchange(what, *slot).status();
        } else {
          break;
        }
        if (!transport::SendResponse(**conn, verdict, group_.version(), {}).ok()) break;
      }
    }
  }

  Group& group_;
  DriverSetting setting_;
  const std::unique_ptr<StepDriver> driver_;
  const std::unique_ptr<transport::Listener> listener_;
  std::thread thread_;
};

// A broadcast that runs aside (a DataServer handler already answered the peer whose
// partial completed the chunk) has no worker to resend it: it retries until the peer
// takes it, here after two failed connections.
TEST(HybridTest, ABroadcastRunningAsideRetriesUntilThePeerTakesIt) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(*DeliverReduced(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*second.CommitBroadcast(kStep0), CommitOutcome::kPending);  // first's chunk is missing

  ExchangePeer peer(second);  // server 3, replica group 1's holder of shard 1
  DriverSetting setting;
  std::atomic<int> connects = 0;
  {
    const std::unique_ptr<StepDriver> driver = setting.Driver([&](int rank) -> absl::StatusOr<std::unique_ptr<transport::Connection>> {
      EXPECT_EQ(rank, 3);
      if (++connects <= 2) return absl::UnavailableError("not yet");
      return transport::ConnectTcp("127.0.0.1", peer.port(), absl::Seconds(10));
    }, absl::Seconds(10));
    driver->ContinueAside(r.group[0], 0, CommitOutcome::kBroadcast);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    for (Group* group : {&second, &first}) {
      const absl::StatusOr<int64_t> reached = group->WaitVersion(1, deadline);
      ASSERT_TRUE(reached.ok()) << reached.status();
    }
  }
  EXPECT_EQ(connects, 3);
  EXPECT_EQ(setting.stats.exchange_bytes_sent, 4 * sizeof(float));  // chunk 0: elements 0 to 3
  EXPECT_EQ(Params(first), Params(second));
  EXPECT_EQ(Params(first)[0], -3.0f);  // (2 + 4) / 2
}

// A peer that already took a chunk (its answer to the first send was lost) answers a
// resend with AlreadyExists: delivered, and counted in exchange_bytes_sent then, once, as
// the peer counted it when it took it.
TEST(HybridTest, AChunkThePeerAlreadyTookCountsAsDeliveredOnce) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(*DeliverReduced(first, second, 0), CommitOutcome::kPending);  // the lost answer's send
  ASSERT_EQ(*DeliverReduced(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*second.CommitBroadcast(kStep0), CommitOutcome::kApplied);

  ExchangePeer peer(second);
  DriverSetting setting;
  const std::unique_ptr<StepDriver> driver =
      setting.Driver([&](int) { return transport::ConnectTcp("127.0.0.1", peer.port(), absl::Seconds(10)); },
                     absl::Seconds(10));
  const absl::Status resent = driver->Continue(first, 0, CommitOutcome::kBroadcast);
  EXPECT_TRUE(resent.ok()) << resent;
  EXPECT_EQ(first.version(), 1);
  EXPECT_EQ(setting.stats.exchange_bytes_sent, 4 * sizeof(float));  // chunk 0: elements 0 to 3
  EXPECT_EQ(Params(first), Params(second));
}

// The exchange over TCP across a checkpoint load that both servers commit, first one,
// then the other. A partial of the loaded state reaches a peer that has not committed
// the load yet: the peer waits for its own commit and takes it then. A partial of the
// replaced state reaches a peer that has committed it: the peer refuses it, and the
// worker whose contribution sent it hears Aborted.
TEST(HybridTest, TheExchangeCarriesTheLoadItsStateComesFrom) {
  constexpr uint64_t kLoad = 77;
  for (const bool sender_loads_first : {true, false}) {
    SCOPED_TRACE(sender_loads_first ? "the sender committed first" : "the peer committed first");
    Replicas r = MakeReplicas(2);
    Group& first = *r.group[0];
    Group& second = *r.group[1];
    ExchangePeer peer(second);
    DriverSetting setting;
    const std::unique_ptr<StepDriver> driver = setting.Driver(
        [&](int) { return transport::ConnectTcp("127.0.0.1", peer.port(), absl::Seconds(10)); }, absl::Seconds(10));
    LoadZeros(sender_loads_first ? first : second, kLoad);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_EQ(*Contribute(first, 0, 0, std::vector<float>(10, 6.0f)), CommitOutcome::kShare);
    absl::Status sent;
    std::thread sender([&] { sent = driver->Continue(first, 0, CommitOutcome::kShare); });
    absl::SleepFor(absl::Milliseconds(200));  // the message waits at the peer, or was refused
    LoadZeros(sender_loads_first ? second : first, kLoad);
    sender.join();
    ASSERT_FALSE(HasFatalFailure());
    if (!sender_loads_first) {
      EXPECT_TRUE(absl::IsAborted(sent)) << sent;
      EXPECT_THAT(sent.message(), HasSubstr("server 3 refused the partial gradient of replica group 0 for group "
                                            "'g' step 0: "));
      EXPECT_EQ(setting.stats.exchange_bytes_sent, 0);
      continue;
    }
    ASSERT_TRUE(sent.ok()) << sent;
    EXPECT_EQ(setting.stats.exchange_bytes_sent, 6 * sizeof(float));  // chunk 1: elements 4 to 9
    // The rest of the step, by hand: second holds first's partial of its chunk.
    const ExchangeRound redo{.step = 0, .load_epoch = kLoad};
    ASSERT_EQ(*Contribute(second, 0, 1, std::vector<float>(10, 2.0f)), CommitOutcome::kShare);
    ASSERT_EQ(*DeliverPartial(second, first, 0), CommitOutcome::kBroadcast);
    ASSERT_EQ(*second.CommitOwnPartial(redo), CommitOutcome::kBroadcast);
    ASSERT_NO_FATAL_FAILURE(BroadcastAndApply(first, second, redo));
    EXPECT_EQ(Params(first), (std::vector<float>{-4, -4, -4, -4, -4, -4, -4, -4, -4, 0}));  // (6 + 2) / 2
    EXPECT_EQ(Params(first), Params(second));
  }
}

// A server that stops while a broadcast waits on a hung peer (it takes the connection
// but never answers) does not wait for the send's timeout.
TEST(HybridTest, StoppingTheDriverCutsASendToAHungPeerShort) {
  Replicas r = MakeReplicas(2);
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());
  // Connections queue in its backlog; nothing reads them.
  absl::StatusOr<std::unique_ptr<transport::Listener>> hung = transport::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(hung.ok()) << hung.status();
  const int port = (*hung)->port();
  DriverSetting setting;
  std::atomic<int> connects = 0;
  auto driver = setting.Driver([&](int) {
    ++connects;
    return transport::ConnectTcp("127.0.0.1", port, absl::Seconds(60));
  }, absl::Seconds(60));
  driver->ContinueAside(r.group[0], 0, CommitOutcome::kBroadcast);
  while (connects == 0) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(100));  // the request is sent; the answer never comes
  absl::Notification destroyed;
  std::thread stopper([&] {
    driver.reset();
    destroyed.Notify();
  });
  EXPECT_TRUE(destroyed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  hung->reset();  // closing the backlog resets the connection, should the test have failed
  stopper.join();
  EXPECT_EQ(r.group[0]->version(), 0);  // nothing was delivered
  EXPECT_EQ(setting.stats.exchange_bytes_sent, 0);
}

// Every worker's contribution to step 0 is answered before the exchange has finished
// step 0 on every server: a contribution to step 1 that comes meanwhile waits for it
// instead of being refused as a future one.
TEST(HybridTest, AContributionToTheNextStepWaitsForTheExchangeToFinish) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  DriverSetting setting;
  const std::unique_ptr<StepDriver> driver =
      setting.Driver([](int) { return absl::UnavailableError("no peers here"); }, absl::Seconds(20));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const absl::Status early = driver->BeginScatter(first, 1, 0, DType::kFloat32, deadline).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(early)) << early;  // step 0 has nothing yet: refused
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());

  std::thread finish([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_EQ(*DeliverReduced(second, first, 0), CommitOutcome::kPending);
    EXPECT_EQ(*first.CommitBroadcast(kStep0), CommitOutcome::kApplied);
  });
  const absl::StatusOr<ReceiveSlot> next = driver->BeginScatter(first, 1, 0, DType::kFloat32, deadline);
  finish.join();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->step, 1);
  EXPECT_EQ(first.version(), 1);
  first.AbortScatter(*next);
}

// The same early contribution waits no longer than its request's deadline, however long
// the server would wait for a peer: its worker has given up by then.
TEST(HybridTest, AnEarlyContributionWaitsUntilItsRequestsDeadlineAtMost) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  DriverSetting setting;
  const std::unique_ptr<StepDriver> driver =
      setting.Driver([](int) { return absl::UnavailableError("no peers here"); }, absl::Seconds(60));
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());
  const absl::Time start = absl::Now();
  const absl::Status early =
      driver->BeginScatter(first, 1, 0, DType::kFloat32, absl::Now() + absl::Milliseconds(200)).status();
  EXPECT_TRUE(absl::IsDeadlineExceeded(early)) << early;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));  // not the peer timeout
  EXPECT_EQ(first.version(), 0);
}

// A replica group that finished step 0 sends its partial of step 1 while this one
// still waits for the last reduced chunk of step 0: early, not wrong.
TEST(HybridTest, APartialFromAReplicaGroupAStepAheadWaitsUntilThisOneCatchesUp) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  // Nothing of step 0 is in yet: a partial of step 1 is wrong, and so is one of step 2.
  EXPECT_FALSE(*first.AwaitEarlyStep(1, absl::InfiniteFuture()));
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(*DeliverReduced(second, first, 0), CommitOutcome::kPending);
  ASSERT_EQ(*DeliverReduced(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*second.CommitBroadcast(kStep0), CommitOutcome::kApplied);  // first's own is in flight
  ASSERT_EQ(*Contribute(second, 1, 1, std::vector<float>(10, 4.0f)), CommitOutcome::kShare);
  EXPECT_FALSE(*first.AwaitEarlyStep(2, absl::InfiniteFuture()));

  const absl::Status early = DeliverPartial(second, first, 1).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(early)) << early;
  const absl::Status timed_out = first.AwaitEarlyStep(1, absl::Now() + absl::Milliseconds(20)).status();
  EXPECT_TRUE(absl::IsDeadlineExceeded(timed_out)) << timed_out;
  EXPECT_THAT(timed_out.message(), HasSubstr("step 1 came early"));

  // Step 0 finishes between the refusal and the wait: the partial is taken at once.
  ASSERT_EQ(*first.CommitBroadcast(kStep0), CommitOutcome::kApplied);
  EXPECT_TRUE(*first.AwaitEarlyStep(1, absl::InfinitePast()));
  EXPECT_EQ(*DeliverPartial(second, first, 1), CommitOutcome::kPending);
}

// The wait for this replica group to catch up with an early partial ends when a load
// replaces the state: trying again then refuses the partial, of the state the load
// replaced, instead of holding its sender until the peer timeout.
TEST(HybridTest, ALoadEndsTheWaitForAnEarlyPartial) {
  Replicas r = MakeReplicas(2);
  Group& first = *r.group[0];
  Group& second = *r.group[1];
  ReduceChunks(r);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(*DeliverReduced(first, second, 0), CommitOutcome::kPending);
  ASSERT_EQ(*second.CommitBroadcast(kStep0), CommitOutcome::kApplied);  // first lacks second's chunk
  ASSERT_EQ(*Contribute(second, 1, 1, std::vector<float>(10, 4.0f)), CommitOutcome::kShare);
  ASSERT_TRUE(absl::IsFailedPrecondition(DeliverPartial(second, first, 1).status()));
  absl::StatusOr<bool> again;
  const absl::Time start = absl::Now();
  std::thread waiting([&] { again = first.AwaitEarlyStep(1, start + absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(100));
  LoadZeros(first, 0x10ad);
  waiting.join();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  const absl::Status replaced = DeliverPartial(second, first, 1).status();
  EXPECT_TRUE(absl::IsAborted(replaced)) << replaced;
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
