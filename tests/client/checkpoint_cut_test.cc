// ChooseCut, PinRounds and ExplainWait: the cut of a save or export from the servers'
// status, without servers.
#include "client/checkpoint_cut.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

namespace flatshard::client_internal {
namespace {

using ::testing::HasSubstr;
using Cut = std::map<std::string, int64_t>;

// A server's status listing `groups` ({job, group, version, optimizer}) and job "j" in
// `mode`, clipping at `max_grad_norm` (0: none).
v1::ServerStatus Server(const std::vector<std::tuple<std::string, std::string, int64_t, std::string>>& groups,
                        const std::string& mode = "sync", double max_grad_norm = 0) {
  v1::ServerStatus status;
  for (const auto& [job, name, version, optimizer] : groups) {
    v1::GroupStatus& group = *status.add_groups();
    group.set_job(job);
    group.set_group(name);
    group.set_version(version);
    group.set_optimizer(optimizer);
  }
  v1::JobStatus& job = *status.add_jobs();
  job.set_job("j");
  job.set_mode(mode);
  job.set_max_grad_norm(max_grad_norm);
  return status;
}

// `status` with `workers` listed as holding their gradient for group `name`'s step in
// progress (GroupStatus.step_contributors).
v1::ServerStatus Holding(v1::ServerStatus status, const std::string& name, const std::vector<int>& workers) {
  for (v1::GroupStatus& group : *status.mutable_groups()) {
    if (group.group() == name) group.mutable_step_contributors()->Add(workers.begin(), workers.end());
  }
  return status;
}

Cut Chosen(const std::vector<v1::ServerStatus>& statuses, const SentSteps& sent, const CutAt& at) {
  absl::StatusOr<Cut> cut = ChooseCut("j", statuses, sent, at);
  EXPECT_TRUE(cut.ok()) << cut.status();
  return cut.value_or(Cut{});
}

TEST(ChooseCutTest, ByDefaultEachGroupIsAtTheHighestVersionAnyServerHas) {
  const std::vector<v1::ServerStatus> statuses = {
      Server({{"j", "a", 3, "adamw"}, {"j", "b", 2, "sgd"}, {"other", "a", 9, "sgd"}}),
      Server({{"j", "a", 2, "adamw"}, {"j", "b", 3, "sgd"}})};
  EXPECT_EQ(ServerVersions("j", statuses[0]), (Cut{{"a", 3}, {"b", 2}}));
  EXPECT_EQ(Chosen(statuses, SentSteps(), CutAt()), (Cut{{"a", 3}, {"b", 3}}));
}

// A clipped job's groups step together, once the global norm is known: groups seen
// behind the others are finishing that step, and the default cut waits for them rather
// than cut inside it (which would also leave a group pinned before the step that the
// others' pins wait for, on a server that steps the groups one after another).
TEST(ChooseCutTest, AClippedJobsGroupsAreCutTogether) {
  const std::vector<v1::ServerStatus> unclipped = {
      Server({{"j", "a", 5, "adamw"}, {"j", "b", 4, "sgd"}, {"j", "e", 0, "frozen"}})};
  EXPECT_EQ(Chosen(unclipped, SentSteps(), CutAt()), (Cut{{"a", 5}, {"b", 4}, {"e", 0}}));
  const std::vector<v1::ServerStatus> clipped = {
      Server({{"j", "a", 5, "adamw"}, {"j", "b", 4, "sgd"}, {"j", "e", 0, "frozen"}}, "sync", 1.0)};
  EXPECT_EQ(Chosen(clipped, SentSteps(), CutAt()), (Cut{{"a", 5}, {"b", 5}, {"e", 0}}));
  v1::ServerStatus skipping = unclipped[0];
  skipping.mutable_jobs(0)->set_skip_nonfinite(true);
  EXPECT_EQ(Chosen({skipping}, SentSteps(), CutAt()), (Cut{{"a", 5}, {"b", 5}, {"e", 0}}));
}

// Worker 1 sent step 3 of both groups; "b" has taken it, "a" waits for other workers.
// The cut waits for "a" to take it where a server holds worker 1's gradient for it, and
// not where none does (a load dropped it: the step would wait for worker 1 itself).
TEST(ChooseCutTest, AWorkerBetweenStepsCutsAfterTheStepItSentLast) {
  const v1::ServerStatus server = Server({{"j", "a", 3, "adamw"}, {"j", "b", 4, "sgd"}});
  SentSteps sent(/*worker_rank=*/1);
  sent.Register("a");
  sent.Register("b");
  sent.Record("a", 3);
  EXPECT_EQ(Chosen({Holding(server, "a", {1})}, sent, CutAt()), (Cut{{"a", 3}, {"b", 4}}));  // inside its step
  sent.Record("b", 3);
  EXPECT_EQ(Chosen({server, Holding(server, "a", {0, 1})}, sent, CutAt()), (Cut{{"a", 4}, {"b", 4}}));
  EXPECT_EQ(Chosen({Holding(server, "a", {0})}, sent, CutAt()), (Cut{{"a", 3}, {"b", 4}}));
  EXPECT_EQ(Chosen({server}, sent, CutAt()), (Cut{{"a", 3}, {"b", 4}}));
}

TEST(ChooseCutTest, AStepBoundaryMovesEveryTrainedGroupToTheHighestAndLeavesFrozenOnes) {
  const std::vector<v1::ServerStatus> statuses = {
      Server({{"j", "a", 5, "adamw"}, {"j", "b", 4, "sgd"}, {"j", "e", 0, "frozen"}}),
      Server({{"j", "a", 4, "adamw"}, {"j", "b", 4, "sgd"}, {"j", "e", 0, "frozen"}})};
  EXPECT_EQ(Chosen(statuses, SentSteps(), CutAt::StepBoundary()), (Cut{{"a", 5}, {"b", 5}, {"e", 0}}));
  SentSteps sent;  // a worker that sent step 5 of both: no group has taken it yet
  sent.Register("a");
  sent.Register("b");
  sent.Record("a", 5);
  sent.Record("b", 5);
  const v1::ServerStatus at_5 = Server({{"j", "a", 5, "adamw"}, {"j", "b", 5, "sgd"}});
  EXPECT_EQ(Chosen({Holding(Holding(at_5, "a", {0}), "b", {0})}, sent, CutAt::StepBoundary()),
            (Cut{{"a", 6}, {"b", 6}}));
  EXPECT_EQ(Chosen({at_5}, sent, CutAt::StepBoundary()), (Cut{{"a", 5}, {"b", 5}}));  // its gradients were dropped
}

TEST(ChooseCutTest, AStepBoundaryIsRefusedWhereThereIsNone) {
  const v1::ServerStatus apart = Server({{"j", "a", 7, "adamw"}, {"j", "b", 5, "sgd"}, {"j", "e", 0, "frozen"}});
  absl::StatusOr<Cut> cut = ChooseCut("j", {apart}, SentSteps(), CutAt::StepBoundary());
  EXPECT_TRUE(absl::IsFailedPrecondition(cut.status())) << cut.status();
  EXPECT_THAT(std::string(cut.status().message()), HasSubstr("versions 5 ('b') to 7 ('a')"));

  const v1::ServerStatus async = Server({{"j", "a", 7, "adamw"}, {"j", "b", 7, "sgd"}}, "async");
  cut = ChooseCut("j", {async}, SentSteps(), CutAt::StepBoundary());
  EXPECT_TRUE(absl::IsFailedPrecondition(cut.status())) << cut.status();
  EXPECT_THAT(std::string(cut.status().message()), HasSubstr("asynchronous"));

  SentSteps inside;
  inside.Register("a");
  inside.Register("b");
  inside.Record("a", 7);
  cut = ChooseCut("j", {Server({{"j", "a", 7, "adamw"}, {"j", "b", 7, "sgd"}})}, inside, CutAt::StepBoundary());
  EXPECT_TRUE(absl::IsFailedPrecondition(cut.status())) << cut.status();
  EXPECT_THAT(std::string(cut.status().message()), HasSubstr("inside a step"));
}

TEST(ChooseCutTest, AVersionMovesEveryTrainedGroupThereUnlessOneIsPastIt) {
  const std::vector<v1::ServerStatus> statuses = {
      Server({{"j", "a", 3, "adamw"}, {"j", "b", 2, "sgd"}, {"j", "e", 1, "frozen"}})};
  EXPECT_EQ(Chosen(statuses, SentSteps(), CutAt::Version(3)), (Cut{{"a", 3}, {"b", 3}, {"e", 1}}));
  EXPECT_EQ(Chosen(statuses, SentSteps(), CutAt::Version(10)), (Cut{{"a", 10}, {"b", 10}, {"e", 1}}));
  absl::StatusOr<Cut> cut = ChooseCut("j", statuses, SentSteps(), CutAt::Version(2));
  EXPECT_TRUE(absl::IsFailedPrecondition(cut.status())) << cut.status();
  EXPECT_THAT(std::string(cut.status().message()), HasSubstr("group 'a' of job 'j' is at version 3"));
  cut = ChooseCut("j", statuses, SentSteps(), CutAt::Version(-1));
  EXPECT_TRUE(absl::IsInvalidArgument(cut.status())) << cut.status();
}

TEST(ChooseCutTest, OnlyADefaultCutMovesOnInLaterRounds) {
  EXPECT_EQ(PinRounds(CutAt()), 10);
  EXPECT_EQ(PinRounds(CutAt::StepBoundary()), 1);
  EXPECT_EQ(PinRounds(CutAt::Version(4)), 1);
}

TEST(ExplainWaitTest, ATimedOutCutSaysWhatItWaitedFor) {
  const absl::Status timed_out = absl::DeadlineExceededError("group 'a' is at version 3");
  SentSteps sent;
  EXPECT_EQ(ExplainWait(timed_out, sent, CutAt()), timed_out);  // nothing sent: nothing to add
  EXPECT_THAT(std::string(ExplainWait(timed_out, sent, CutAt::Version(8)).message()),
              HasSubstr("group 'a' is at version 3 (the cut is at version 8; is the job training towards it?)"));
  EXPECT_THAT(std::string(ExplainWait(timed_out, sent, CutAt::StepBoundary()).message()),
              HasSubstr("(the cut is at the end of the step in progress"));
  sent.Record("a", 3);
  const absl::Status explained = ExplainWait(timed_out, sent, CutAt());
  EXPECT_TRUE(absl::IsDeadlineExceeded(explained));
  EXPECT_THAT(std::string(explained.message()), HasSubstr("after the step this worker sent last"));
  const absl::Status other = absl::AbortedError("moved on");
  EXPECT_EQ(ExplainWait(other, sent, CutAt::Version(8)), other);
}

}  // namespace
}  // namespace flatshard::client_internal
