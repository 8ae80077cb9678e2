#include "server/staged_loads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/time/clock.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

// Buffers whose release the tests count.
std::atomic<int> freed{0};
void CountedFree(void* data) {
  std::free(data);
  freed.fetch_add(1);
}

// A staged load of one shard: `numel` parameters and an "exp_avg" of as many.
StagedGroups Staged(size_t numel) {
  LoadedShard shard;
  shard.params = ShardBuffer(std::malloc(numel * sizeof(float)), numel * sizeof(float), CountedFree);
  shard.state.emplace_back("exp_avg",
                           ShardBuffer(std::malloc(numel * sizeof(float)), numel * sizeof(float), CountedFree));
  StagedGroups groups;
  groups.push_back({nullptr, std::move(shard), {}});
  return groups;
}

TEST(StagedLoadsTest, ALoadIsItsIdNotItsName) {
  StagedLoads loads(absl::Minutes(10));
  // Two jobs loading one checkpoint at once (or two clients of one job) do not meet.
  loads.Add(1, "ckpt", "a", Staged(16));
  loads.Add(2, "ckpt", "b", Staged(32));
  const std::vector<StagedLoadRow> rows = loads.Rows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].job, "a");
  EXPECT_EQ(rows[0].bytes, 2 * 16 * sizeof(float));
  EXPECT_EQ(rows[1].job, "b");
  EXPECT_EQ(rows[1].bytes, 2 * 32 * sizeof(float));
  EXPECT_EQ(rows[1].expires_at - rows[1].staged_at, absl::Minutes(10));

  absl::StatusOr<StagedGroups> taken = loads.Take(2, "ckpt");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->front().shard.params.size(), 32 * sizeof(float));
  const absl::Status other_name = loads.Take(1, "other").status();
  EXPECT_EQ(other_name.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other_name.message()), HasSubstr("load 1 stages checkpoint 'ckpt', not 'other'"));
  ASSERT_TRUE(loads.Take(1, "ckpt").ok());  // a wrong name took nothing
  const absl::Status twice = loads.Take(1, "ckpt").status();
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(twice.message(), "checkpoint 'ckpt' was not prepared for loading here as load 1");
  EXPECT_TRUE(loads.Rows().empty());
}

TEST(StagedLoadsTest, AbortedAndReplacedLoadsFreeTheirMemory) {
  StagedLoads loads(absl::Minutes(10));
  const int before = freed.load();
  loads.Add(5, "ckpt", "job", Staged(8));
  loads.Add(5, "ckpt", "job", Staged(8));  // a retried preparation replaces the first
  EXPECT_EQ(freed.load() - before, 2);
  ASSERT_EQ(loads.Rows().size(), 1u);
  loads.Abort(6);  // not staged: nothing happens
  ASSERT_EQ(loads.Rows().size(), 1u);
  loads.Abort(5);
  EXPECT_EQ(freed.load() - before, 4);
  EXPECT_TRUE(loads.Rows().empty());
  const absl::Status committed = loads.Take(5, "ckpt").status();
  EXPECT_EQ(committed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(committed.message()), HasSubstr("its staging was dropped (aborted)"));
}

TEST(StagedLoadsTest, ALoadWithoutCommitIsDroppedAtItsTimeoutAndItsCommitSaysWhy) {
  StagedLoads loads(absl::Milliseconds(300));
  const int before = freed.load();
  loads.Add(7, "ckpt", "job", Staged(1 << 18));
  ASSERT_EQ(loads.Rows().size(), 1u);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  // The buffers are freed just after the load leaves the list (outside the lock).
  while ((!loads.Rows().empty() || freed.load() - before < 2) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(loads.Rows().empty()) << "the load was not dropped";
  EXPECT_EQ(freed.load() - before, 2);
  const absl::Status committed = loads.Take(7, "ckpt").status();
  EXPECT_EQ(committed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(committed.message()),
              HasSubstr("its staging was dropped (no commit came within 300ms of its staging or last "
                        "renewal (--staged_load_timeout))"));
  // A load staged later keeps its own deadline (the thread waits for the new one).
  loads.Add(8, "ckpt", "job", Staged(4));
  EXPECT_EQ(loads.Rows().size(), 1u);
  while (!loads.Rows().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(loads.Rows().empty());
}

// A renewal holds a load for another timeout from then: renewed every 150 ms, a load
// with a 400 ms timeout outlives a second; left alone, it goes at its timeout, and a
// renewal after that says why.
TEST(StagedLoadsTest, RenewalsKeepALoadPastItsTimeout) {
  StagedLoads loads(absl::Milliseconds(400));
  loads.Add(5, "ckpt", "job", Staged(4));
  const absl::Time staged = absl::Now();
  while (absl::Now() - staged < absl::Seconds(1)) {
    absl::SleepFor(absl::Milliseconds(150));
    ASSERT_TRUE(loads.Renew(5, "ckpt").ok()) << "after " << absl::Now() - staged;
  }
  const std::vector<StagedLoadRow> rows = loads.Rows();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_GT(rows[0].expires_at, staged + absl::Seconds(1));
  EXPECT_EQ(loads.Renew(5, "other").code(), absl::StatusCode::kFailedPrecondition);
  for (int i = 0; i < 100 && !loads.Rows().empty(); ++i) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(loads.Rows().empty()) << "the load was not dropped once renewals stopped";
  const absl::Status late = loads.Renew(5, "ckpt");
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(late.message()), HasSubstr("its staging was dropped (no commit came within 400ms"));
}

TEST(StagedLoadsTest, ADeletedJobTakesOnlyItsOwnLoads) {
  StagedLoads loads(absl::Minutes(10));
  loads.Add(1, "ckpt", "a", Staged(4));
  loads.Abort(1);
  loads.Add(1, "ckpt", "a", Staged(4));  // prepared again after its abort: the latest drop explains
  loads.Add(2, "ckpt", "b", Staged(4));
  loads.DropJob("a");
  ASSERT_EQ(loads.Rows().size(), 1u);
  EXPECT_EQ(loads.Rows()[0].job, "b");
  EXPECT_THAT(std::string(loads.Take(1, "ckpt").status().message()), HasSubstr("(job 'a' was deleted)"));
  EXPECT_TRUE(loads.Take(2, "ckpt").ok());
}

// Only the last kRemembered drops are explained; older ones are plain "not prepared".
TEST(StagedLoadsTest, RemembersTheLastDrops) {
  StagedLoads loads(absl::Minutes(10));
  for (uint64_t id = 1; id <= StagedLoads::kRemembered + 1; ++id) {
    loads.Add(id, "ckpt", "job", Staged(1));
    loads.Abort(id);
  }
  EXPECT_THAT(std::string(loads.Take(1, "ckpt").status().message()), ::testing::Not(HasSubstr("dropped")));
  EXPECT_THAT(std::string(loads.Take(2, "ckpt").status().message()), HasSubstr("dropped (aborted)"));
}

}  // namespace
}  // namespace flatshard::server
