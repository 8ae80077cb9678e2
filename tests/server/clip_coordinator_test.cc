// Two in-process "servers" (registries + coordinators wired to each other) clip a job of
// two groups by its global norm; checked against a float64 computation of torch's
// clip_grad_norm_ formula.
#include "server/clip_coordinator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

namespace flatshard::server {
namespace {

constexpr int kServers = 2;

struct FakeServer {
  std::unique_ptr<Registry> registry;
  std::unique_ptr<ClipCoordinator> clip;
};

class ClipCoordinatorTest : public ::testing::Test {
 protected:
  void Start(double max_norm, double norm_type, bool skip_nonfinite = false) {
    for (int rank = 0; rank < kServers; ++rank) {
      servers_[rank].registry = std::make_unique<Registry>(rank, kServers);
      servers_[rank].clip = std::make_unique<ClipCoordinator>(
          *servers_[rank].registry, rank, kServers,
          [this](int peer, const std::string& job, int64_t step, double partial, uint64_t epoch) {
            if (unreachable_) return absl::UnavailableError("peer unreachable");
            return servers_[peer].clip->RecordPartial(job, step, sender_, partial, epoch);
          });
      ASSERT_TRUE(servers_[rank].registry
                      ->ConfigureJob("job", {.num_workers = 1, .max_grad_norm = max_norm,
                                            .norm_type = norm_type, .skip_nonfinite = skip_nonfinite})
                      .ok());
      for (const char* name : {"a", "b"}) {
        ASSERT_TRUE(servers_[rank]
                        .registry->RegisterGroup("job", name, {{"w", {4}, DType::kFloat32}}, 0,
                                                kernels::SgdHyperparams{.lr = 1.0f})
                        .ok());
      }
    }
  }

  // Worker 0's gradient for group `name` on server `rank` (2 of the 4 elements).
  absl::Status Contribute(int rank, const std::string& name, std::vector<float> shard, int64_t step = 0) {
    auto group = servers_[rank].registry->FindGroup("job", name);
    auto slot = (*group)->BeginScatter(step, 0, DType::kFloat32);
    if (!slot.ok()) return slot.status();
    std::memcpy(slot->buffer.data(), shard.data(), slot->buffer.size());
    auto outcome = (*group)->CommitScatter(*slot);
    if (!outcome.ok()) return outcome.status();
    EXPECT_EQ(*outcome, CommitOutcome::kReduced);
    sender_ = rank;
    return servers_[rank].clip->OnGroupReduced("job", step);
  }

  std::vector<float> Params(int rank, const std::string& name) {
    auto group = servers_[rank].registry->FindGroup("job", name);
    auto snapshot = (*group)->Gather(0, DType::kFloat32, absl::InfiniteFuture());
    std::vector<float> values(2);
    std::memcpy(values.data(), snapshot->bytes->data(), 8);
    return values;
  }

  int64_t Version(int rank, const std::string& name) {
    return (*servers_[rank].registry->FindGroup("job", name))->version();
  }

  FakeServer servers_[kServers];
  int sender_ = 0;
  bool unreachable_ = false;  // every send fails
};

// Shards: server 0 holds elements 0-1 of each group, server 1 elements 2-3.
const std::vector<float> kGrads[2][2] = {{{3, 0}, {0, 4}}, {{1, -2}, {2, -1}}};  // [rank][group]

TEST_F(ClipCoordinatorTest, GroupsStepTogetherWithTheGlobalL2Coefficient) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  ASSERT_TRUE(Contribute(0, "a", kGrads[0][0]).ok());
  ASSERT_TRUE(Contribute(0, "b", kGrads[0][1]).ok());  // server 0 shares its partial
  ASSERT_TRUE(Contribute(1, "a", kGrads[1][0]).ok());
  EXPECT_EQ(Version(0, "a"), 0);  // server 1's share is not in yet
  EXPECT_EQ(Version(1, "a"), 0);
  ASSERT_TRUE(Contribute(1, "b", kGrads[1][1]).ok());
  for (int rank = 0; rank < kServers; ++rank) {
    EXPECT_EQ(Version(rank, "a"), 1);
    EXPECT_EQ(Version(rank, "b"), 1);
  }
  double sum_sq = 0;
  for (const auto& per_rank : kGrads) {
    for (const auto& grad : per_rank) {
      for (float g : grad) sum_sq += double{g} * g;
    }
  }
  const double coef = 1.0 / (std::sqrt(sum_sq) + 1e-6);  // sqrt(35): clips
  for (int rank = 0; rank < kServers; ++rank) {
    for (int g = 0; g < 2; ++g) {
      const std::vector<float> params = Params(rank, g == 0 ? "a" : "b");
      for (int i = 0; i < 2; ++i) {
        EXPECT_NEAR(params[i], -kGrads[rank][g][i] * coef, 1e-6) << rank << " " << g << " " << i;
      }
    }
  }
}

// The norm stays readable for logging: every server has the same one, a step not yet
// reduced is waited for, and one forgotten (a load) is NotFound once applied.
TEST_F(ClipCoordinatorTest, TheTotalNormOfAStepIsKeptForLogging) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  const absl::Time soon = absl::Now() + absl::Milliseconds(50);
  EXPECT_TRUE(absl::IsDeadlineExceeded(servers_[0].clip->TotalNorm("job", 0, soon).status()));
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", kGrads[rank][0]).ok());
    ASSERT_TRUE(Contribute(rank, "b", kGrads[rank][1]).ok());
  }
  for (int rank = 0; rank < kServers; ++rank) {
    const absl::StatusOr<double> norm = servers_[rank].clip->TotalNorm("job", 0, absl::InfiniteFuture());
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_NEAR(*norm, std::sqrt(35.0), 1e-12) << rank;  // 9 + 16 + 1 + 4 + 4 + 1
  }
  servers_[0].clip->OnLoad("job", 42);
  EXPECT_TRUE(absl::IsNotFound(servers_[0].clip->TotalNorm("job", 0, absl::InfiniteFuture()).status()));
  ASSERT_TRUE(servers_[0].registry->ConfigureJob("plain", {.num_workers = 1}).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(servers_[0].clip->TotalNorm("plain", 0, absl::InfiniteFuture()).status()));
}

// A wait for a norm whose caller went away ends within kCallerCheck, Cancelled.
TEST_F(ClipCoordinatorTest, AWaitForANormEndsOnceItsCallerHasGone) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  std::atomic<bool> gone{false};
  absl::Status waited;
  std::thread waiter([&] {
    waited =
        servers_[0].clip->TotalNorm("job", 0, absl::Now() + absl::Seconds(60), [&] { return gone.load(); }).status();
  });
  absl::SleepFor(absl::Milliseconds(250));
  const absl::Time left_at = absl::Now();
  gone = true;
  waiter.join();
  EXPECT_LT(absl::Now() - left_at, absl::Seconds(10)) << "the wait ran to its deadline";
  EXPECT_TRUE(absl::IsCancelled(waited)) << waited;
  EXPECT_EQ(waited.message(), "the caller went away while waiting for the gradient norm of step 0 of job 'job'");
}

// A server shutting down ends the waits for a norm that will not come, and refuses later
// ones, with its reason, instead of holding its shutdown until their deadlines.
TEST_F(ClipCoordinatorTest, StoppingEndsTheWaitsForANorm) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  absl::Status waited;
  std::thread waiter([&] { waited = servers_[0].clip->TotalNorm("job", 0, absl::Now() + absl::Seconds(60)).status(); });
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time stopped_at = absl::Now();
  const absl::Status stopping = absl::UnavailableError("server 0 is shutting down");
  servers_[0].clip->Stop(stopping);
  waiter.join();
  EXPECT_LT(absl::Now() - stopped_at, absl::Seconds(10)) << "the wait ran to its deadline";
  EXPECT_EQ(waited, stopping);
  servers_[0].clip->Stop(absl::InternalError("a second reason"));  // the first one stays
  EXPECT_EQ(servers_[0].clip->TotalNorm("job", 1, absl::InfiniteFuture()).status(), stopping);
}

// A load while a step is in progress: server 0 has shared its norm share of step 0
// (server 1 holds it), server 1 has not reduced yet. Both load version 0 again. The shares
// of the replaced state count for nothing: the one server 1 holds is dropped, one still in
// flight from before the load is ignored, and one that comes from a server that
// committed the load first is refused until this one commits it too. The step taken
// again is clipped by its own gradients' norm, on both servers.
TEST_F(ClipCoordinatorTest, ALoadDropsTheNormSharesOfTheStateItReplaced) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  ASSERT_TRUE(Contribute(0, "a", {30, 0}).ok());
  ASSERT_TRUE(Contribute(0, "b", {0, 40}).ok());  // shared with server 1: 2500 of the old norm
  auto load = [&](int rank) {
    for (const char* name : {"a", "b"}) {
      absl::StatusOr<ShardBuffer> zeros = AllocateHostUnwritten(2 * sizeof(float), "test");
      ASSERT_TRUE(zeros.ok()) << zeros.status();
      std::fill_n(zeros->floats(), 2, 0.0f);
      LoadedShard loaded;
      loaded.params = *std::move(zeros);
      ASSERT_TRUE((*servers_[rank].registry->FindGroup("job", name))->Restore(std::move(loaded), 42).ok());
    }
    servers_[rank].clip->OnLoad("job", 42);
  };
  load(0);
  const absl::Status early = servers_[1].clip->RecordPartial("job", 0, 0, 2500.0, 42);
  EXPECT_TRUE(absl::IsUnavailable(early)) << early;
  EXPECT_THAT(early.message(), ::testing::HasSubstr("has not committed yet"));
  load(1);
  EXPECT_TRUE(servers_[1].clip->RecordPartial("job", 0, 0, 2500.0, 0).ok());  // in flight before the load
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", kGrads[rank][0]).ok());
    ASSERT_TRUE(Contribute(rank, "b", kGrads[rank][1]).ok());
  }
  const double coef = 1.0 / (std::sqrt(35.0) + 1e-6);
  for (int rank = 0; rank < kServers; ++rank) {
    EXPECT_NEAR(*servers_[rank].clip->TotalNorm("job", 0, absl::InfiniteFuture()), std::sqrt(35.0), 1e-12);
    for (int g = 0; g < 2; ++g) {
      const std::vector<float> params = Params(rank, g == 0 ? "a" : "b");
      for (int i = 0; i < 2; ++i) EXPECT_NEAR(params[i], -kGrads[rank][g][i] * coef, 1e-6) << rank << g << i;
    }
  }
}

// skip_nonfinite without clipping: a step with an inf (or NaN) anywhere is skipped on
// every server (nothing moves); the next finite one steps, unscaled.
TEST_F(ClipCoordinatorTest, ANonFiniteStepIsSkippedEverywhere) {
  Start(/*max_norm=*/0.0, /*norm_type=*/2.0, /*skip_nonfinite=*/true);
  const float inf = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(Contribute(0, "a", {1, 2}).ok());
  ASSERT_TRUE(Contribute(0, "b", {3, 4}).ok());
  ASSERT_TRUE(Contribute(1, "a", {inf, 5}).ok());  // one element on one server
  ASSERT_TRUE(Contribute(1, "b", {std::nanf(""), 6}).ok());
  for (int rank = 0; rank < kServers; ++rank) {
    EXPECT_EQ(Version(rank, "a"), 1) << rank;
    EXPECT_EQ(Params(rank, "a"), (std::vector<float>{0, 0})) << rank;  // not stepped
    EXPECT_EQ(Params(rank, "b"), (std::vector<float>{0, 0})) << rank;
    EXPECT_TRUE(std::isnan(*servers_[rank].clip->TotalNorm("job", 0, absl::InfiniteFuture()))) << rank;
  }
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", kGrads[rank][0], /*step=*/1).ok());
    ASSERT_TRUE(Contribute(rank, "b", kGrads[rank][1], /*step=*/1).ok());
  }
  EXPECT_EQ(Version(1, "b"), 2);
  EXPECT_EQ(Params(0, "b"), (std::vector<float>{0, -4}));  // SGD lr 1, unclipped
  EXPECT_NEAR(*servers_[0].clip->TotalNorm("job", 1, absl::InfiniteFuture()), std::sqrt(35.0), 1e-12);
}

TEST_F(ClipCoordinatorTest, InfNormAndNoScalingBelowTheBound) {
  Start(/*max_norm=*/10.0, std::numeric_limits<double>::infinity());  // max |g| = 4 < 10
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", kGrads[rank][0]).ok());
    ASSERT_TRUE(Contribute(rank, "b", kGrads[rank][1]).ok());
  }
  EXPECT_EQ(Params(0, "b"), (std::vector<float>{0, -4}));  // SGD lr 1, unscaled
  EXPECT_EQ(Params(1, "a"), (std::vector<float>{-1, 2}));
}

// A frozen group of the job sits at version 0 with no gradient ever: it must not hold up
// the step (as torch's clip_grad_norm_ skips parameters without a gradient).
TEST_F(ClipCoordinatorTest, FrozenGroupsNeitherWaitNorCount) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(servers_[rank]
                    .registry->RegisterGroup("job", "frozen", {{"w", {4}, DType::kFloat32}}, 0, Frozen{})
                    .ok());
  }
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", kGrads[rank][0]).ok());
    ASSERT_TRUE(Contribute(rank, "b", kGrads[rank][1]).ok());
  }
  EXPECT_EQ(Version(0, "a"), 1);
  EXPECT_EQ(Version(1, "b"), 1);
  EXPECT_EQ(Version(0, "frozen"), 0);
  EXPECT_NEAR(Params(0, "a")[0], -3.0 / (std::sqrt(35.0) + 1e-6), 1e-6);  // the norm of a and b only
}

// Module buffers (an average group) step as soon as their values are in, outside the
// norm: neither held up by the clipped groups nor counted in their norm, and a skipped
// (non-finite) step still takes them, as torch's forward has updated its buffers.
TEST_F(ClipCoordinatorTest, AverageGroupsStepAtOnceOutsideTheNorm) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0, /*skip_nonfinite=*/true);
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(servers_[rank]
                    .registry->RegisterGroup("job", "buffers", {{"w", {4}, DType::kFloat32}}, 0, Average{})
                    .ok());
  }
  auto send_buffers = [&](int rank, std::vector<float> values, int64_t step) {
    auto group = *servers_[rank].registry->FindGroup("job", "buffers");
    auto slot = group->BeginScatter(step, 0, DType::kFloat32);
    ASSERT_TRUE(slot.ok()) << slot.status();
    std::memcpy(slot->buffer.data(), values.data(), slot->buffer.size());
    auto outcome = group->CommitScatter(*slot);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(*outcome, CommitOutcome::kApplied);
  };
  send_buffers(0, {100, 200}, 0);  // before any gradient: applied at once
  EXPECT_EQ(Version(0, "buffers"), 1);
  EXPECT_EQ(Params(0, "buffers"), (std::vector<float>{100, 200}));
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", kGrads[rank][0]).ok());
    ASSERT_TRUE(Contribute(rank, "b", kGrads[rank][1]).ok());
  }
  send_buffers(1, {1e6, 1e6}, 0);  // after them
  EXPECT_EQ(Version(1, "a"), 1);
  EXPECT_NEAR(Params(0, "a")[0], -3.0 / (std::sqrt(35.0) + 1e-6), 1e-6);  // the norm of a and b only
  absl::StatusOr<double> norm = servers_[1].clip->TotalNorm("job", 0, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(norm.ok()) << norm.status();
  EXPECT_NEAR(*norm, std::sqrt(35.0), 1e-12);
  // A non-finite step: the trained groups skip it, the buffers take their values.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> stepped[kServers] = {Params(0, "a"), Params(1, "a")};
  for (int rank = 0; rank < kServers; ++rank) {
    ASSERT_TRUE(Contribute(rank, "a", {inf, 0}, /*step=*/1).ok());
    ASSERT_TRUE(Contribute(rank, "b", {1, 1}, /*step=*/1).ok());
    send_buffers(rank, {7, 8}, 1);
  }
  for (int rank = 0; rank < kServers; ++rank) {
    EXPECT_EQ(Version(rank, "a"), 2) << rank;
    EXPECT_EQ(Params(rank, "a"), stepped[rank]) << rank;  // skipped
    EXPECT_EQ(Version(rank, "buffers"), 2) << rank;
    EXPECT_EQ(Params(rank, "buffers"), (std::vector<float>{7, 8})) << rank;
  }
}

TEST_F(ClipCoordinatorTest, RejectsSharesForUnknownRanksAndUnclippedJobs) {
  Start(1.0, 2.0);
  EXPECT_EQ(servers_[0].clip->RecordPartial("job", 0, 7, 1.0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(servers_[0].clip->RecordPartial("nojob", 0, 1, 1.0, 0).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(servers_[0].registry->ConfigureJob("plain", {.num_workers = 1}).ok());
  EXPECT_EQ(servers_[0].clip->RecordPartial("plain", 0, 1, 1.0, 0).code(), absl::StatusCode::kInvalidArgument);
}

// A share that could not reach a peer is sent again when asked again (a worker's resend
// of its contribution does that): the step completes on every server.
TEST_F(ClipCoordinatorTest, AShareThatCouldNotBeSentIsSentAgain) {
  Start(/*max_norm=*/1.0, /*norm_type=*/2.0);
  ASSERT_TRUE(Contribute(0, "a", kGrads[0][0]).ok());
  unreachable_ = true;
  const absl::Status failed = Contribute(0, "b", kGrads[0][1]);
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_THAT(failed.message(), ::testing::HasSubstr("send the contribution again"));
  unreachable_ = false;
  ASSERT_TRUE(servers_[0].clip->OnGroupReduced("job", 0).ok());
  ASSERT_TRUE(Contribute(1, "a", kGrads[1][0]).ok());
  ASSERT_TRUE(Contribute(1, "b", kGrads[1][1]).ok());
  for (int rank = 0; rank < kServers; ++rank) {
    EXPECT_EQ(Version(rank, "a"), 1) << rank;
    EXPECT_EQ(Version(rank, "b"), 1) << rank;
  }
}

}  // namespace
}  // namespace flatshard::server
