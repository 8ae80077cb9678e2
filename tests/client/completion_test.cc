#include "client/completion.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

namespace flatshard::client_internal {
namespace {

using ::testing::HasSubstr;

bool Ready(std::future<absl::StatusOr<int64_t>>& future) {
  return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

TEST(CompletionTest, ReadyOnlyAfterTheLastPartWithTheLowestVersion) {
  Completion<absl::StatusOr<int64_t>> completion(3);
  auto future = completion.future();
  completion.Finish(absl::OkStatus(), 7);
  completion.Finish(absl::OkStatus(), 5);
  EXPECT_FALSE(Ready(future));
  completion.Finish(absl::OkStatus(), 6);
  ASSERT_TRUE(Ready(future));
  absl::StatusOr<int64_t> result = future.get();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(*result, 5);
}

TEST(CompletionTest, TheFirstErrorWinsAndVersionsOfFailedPartsAreIgnored) {
  Completion<absl::Status> completion(3);
  auto future = completion.future();
  completion.Finish(absl::OkStatus(), 1);
  completion.Finish(absl::UnavailableError("server a: gone"), 0);
  completion.Finish(absl::InternalError("server b: broken"), 0);
  const absl::Status status = future.get();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_EQ(status.message(), "server a: gone");

  Completion<absl::StatusOr<int64_t>> versioned(2);
  auto versioned_future = versioned.future();
  versioned.Finish(absl::OkStatus(), 4);
  versioned.Finish(absl::DeadlineExceededError("late"), 99);
  EXPECT_TRUE(absl::IsDeadlineExceeded(versioned_future.get().status()));
}

// A resent scatter: servers that already held it answer AlreadyExists. That is the
// result only when no server failed otherwise, whatever the order of the answers.
TEST(CompletionTest, AlreadyExistsGivesWayToAnyOtherError) {
  Completion<absl::Status> resent(3);
  auto all_there = resent.future();
  resent.Finish(absl::AlreadyExistsError("server a: duplicate"), 0);
  resent.Finish(absl::OkStatus(), 0);  // server b lacked it and took it
  resent.Finish(absl::AlreadyExistsError("server c: duplicate"), 0);
  const absl::Status status = all_there.get();
  EXPECT_TRUE(absl::IsAlreadyExists(status)) << status;
  EXPECT_EQ(status.message(), "server a: duplicate");

  Completion<absl::Status> one_failed(3);
  auto failed = one_failed.future();
  one_failed.Finish(absl::AlreadyExistsError("server a: duplicate"), 0);
  one_failed.Finish(absl::UnavailableError("server b: gone"), 0);
  one_failed.Finish(absl::AlreadyExistsError("server c: duplicate"), 0);
  EXPECT_TRUE(absl::IsUnavailable(failed.get())) << "a real failure must not hide behind a duplicate";
}

TEST(CompletionTest, SameVersionRangesThatDifferEndTorn) {
  Completion<absl::StatusOr<int64_t>> torn(2, /*same_version=*/true);
  auto future = torn.future();
  torn.Finish(absl::OkStatus(), 3);
  torn.Finish(absl::OkStatus(), 4);
  const absl::Status status = future.get().status();
  EXPECT_TRUE(absl::IsAborted(status)) << status;
  EXPECT_EQ(status.message(), kTornGather);

  Completion<absl::StatusOr<int64_t>> agreed(2, /*same_version=*/true);
  auto agreed_future = agreed.future();
  agreed.Finish(absl::OkStatus(), 4);
  agreed.Finish(absl::OkStatus(), 4);
  EXPECT_EQ(agreed_future.get().value_or(-1), 4);

  // Without same_version, parts at different versions are fine (different servers).
  Completion<absl::StatusOr<int64_t>> servers(2);
  auto servers_future = servers.future();
  servers.Finish(absl::OkStatus(), 3);
  servers.Finish(absl::OkStatus(), 4);
  EXPECT_EQ(servers_future.get().value_or(-1), 3);
}

// A gather's parts must come from the state of one checkpoint load: parts of two (a load
// committing while the gather read, or one that did not commit everywhere) end it with
// Aborted naming both; ranges of one split part end it torn, to be gathered again.
// `on_ok` hears the load of a gather that completes, and only of one.
TEST(CompletionTest, AGathersPartsMustComeFromOneLoad) {
  std::vector<uint64_t> heard;
  auto record = [&](int64_t, uint64_t load_id) { heard.push_back(load_id); };
  Completion<absl::StatusOr<int64_t>> split(3, /*same_version=*/false, record);
  auto split_future = split.future();
  split.Finish(absl::OkStatus(), 4, 0x5eed);
  split.Finish(absl::OkStatus(), 4, 0x5eed);
  split.Finish(absl::OkStatus(), 4, 0);
  const absl::Status refused = split_future.get().status();
  EXPECT_TRUE(absl::IsAborted(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("from the states of two checkpoint loads (load 5eed and none)"));

  Completion<absl::StatusOr<int64_t>> ranges(2, /*same_version=*/true, record);
  auto ranges_future = ranges.future();
  ranges.Finish(absl::OkStatus(), 4, 1);
  ranges.Finish(absl::OkStatus(), 4, 2);
  EXPECT_EQ(ranges_future.get().status().message(), kTornGather);
  EXPECT_TRUE(heard.empty()) << "a refused gather recorded load " << heard.front();

  Completion<absl::StatusOr<int64_t>> agreed(2, /*same_version=*/false, record);
  auto agreed_future = agreed.future();
  agreed.Finish(absl::OkStatus(), 5, 0x5eed);
  agreed.Finish(absl::OkStatus(), 4, 0x5eed);
  EXPECT_EQ(agreed_future.get().value_or(-1), 4);
  EXPECT_EQ(agreed.load_id(), 0x5eedu);
  EXPECT_EQ(heard, std::vector<uint64_t>{0x5eed});

  // A failed part ends it with its error; nothing is recorded.
  Completion<absl::StatusOr<int64_t>> failed(2, /*same_version=*/false, record);
  auto failed_future = failed.future();
  failed.Finish(absl::OkStatus(), 5, 7);
  failed.Finish(absl::UnavailableError("server b: gone"), 0, 0);
  EXPECT_TRUE(absl::IsUnavailable(failed_future.get().status()));
  EXPECT_EQ(heard.size(), 1u);

  // Scatters' answers name the group's load as it is when each server answers: they may
  // differ, and mean nothing for the scatter.
  Completion<absl::Status> scatter(2);
  auto scatter_future = scatter.future();
  scatter.Finish(absl::OkStatus(), 5, 1);
  scatter.Finish(absl::OkStatus(), 5, 2);
  EXPECT_TRUE(scatter_future.get().ok());
}

TEST(CompletionTest, AnErrorIsReportedRatherThanATornGather) {
  Completion<absl::StatusOr<int64_t>> completion(3, /*same_version=*/true);
  auto future = completion.future();
  completion.Finish(absl::OkStatus(), 3);
  completion.Finish(absl::OkStatus(), 4);
  completion.Finish(absl::NotFoundError("group g"), 0);
  EXPECT_TRUE(absl::IsNotFound(future.get().status()));
}

TEST(CompletionTest, PartsFinishingFromManyThreadsCompleteItOnce) {
  constexpr int kThreads = 8, kPartsPerThread = 500;
  auto completion = std::make_shared<Completion<absl::StatusOr<int64_t>>>(kThreads * kPartsPerThread);
  auto future = completion->future();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([completion, t] {
      for (int i = 0; i < kPartsPerThread; ++i) completion->Finish(absl::OkStatus(), 10 + t + i);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(future.get().value_or(-1), 10);
}

TEST(CompletionTest, ReadyFutureHoldsItsValue) {
  EXPECT_TRUE(absl::IsInvalidArgument(ReadyFuture(absl::InvalidArgumentError("x")).get()));
  EXPECT_EQ(ReadyFuture(absl::StatusOr<int64_t>(12)).get().value_or(-1), 12);
}

// A scatter's `on_ok` hears the lowest version its servers answered, once all took it;
// nothing when one failed or every server already held it (a resend).
TEST(CompletionTest, AScattersOnOkHearsTheLowestVersionAnswered) {
  std::vector<int64_t> heard;
  auto record = [&](int64_t version, uint64_t) { heard.push_back(version); };
  Completion<absl::Status> taken(3, /*same_version=*/false, record);
  taken.Finish(absl::OkStatus(), 8);
  taken.Finish(absl::OkStatus(), 7);
  EXPECT_TRUE(heard.empty()) << "heard before the last server answered";
  taken.Finish(absl::OkStatus(), 8);
  EXPECT_EQ(heard, std::vector<int64_t>{7});

  Completion<absl::Status> failed(2, /*same_version=*/false, record);
  failed.Finish(absl::OkStatus(), 8);
  failed.Finish(absl::UnavailableError("server b: gone"), 0);
  Completion<absl::Status> resent(2, /*same_version=*/false, record);
  resent.Finish(absl::AlreadyExistsError("server a: duplicate"), 0);
  resent.Finish(absl::OkStatus(), 8);
  EXPECT_EQ(heard, std::vector<int64_t>{7});
}

}  // namespace
}  // namespace flatshard::client_internal
