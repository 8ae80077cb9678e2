// LoadCommitOutcome: what a client says of a load's COMMIT from every server's answer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "client/checkpoint_calls.h"

namespace flatshard::client_internal {
namespace {

using ::testing::HasSubstr;

TEST(LoadCommitOutcomeTest, AllOrNoneCommittedIsTheOutcomeAsItIs) {
  EXPECT_TRUE(LoadCommitOutcome("c", {absl::OkStatus(), absl::OkStatus()}).ok());
  const absl::Status none =
      LoadCommitOutcome("c", {absl::FailedPreconditionError("not prepared"), absl::UnavailableError("down")});
  EXPECT_TRUE(absl::IsFailedPrecondition(none)) << none;
  EXPECT_EQ(none.message(), "not prepared");
}

// Some servers installed the checkpoint, others did not confirm it: the job's groups may
// differ between servers, which the message says, naming each side.
TEST(LoadCommitOutcomeTest, ACommitOnSomeServersOnlyNamesBothSides) {
  const absl::Status split = LoadCommitOutcome(
      "step-9", {absl::OkStatus(), absl::UnavailableError("server 127.0.0.1:2 is unreachable"), absl::OkStatus()});
  EXPECT_TRUE(absl::IsUnavailable(split)) << split;
  EXPECT_THAT(split.message(), HasSubstr("checkpoint 'step-9' was installed on servers 0,2, but server 1 did not "
                                         "confirm it (server 127.0.0.1:2 is unreachable): the job's groups may now "
                                         "hold different states"));
  EXPECT_THAT(split.message(), HasSubstr("load the checkpoint again"));
  const absl::Status one =
      LoadCommitOutcome("c", {absl::OkStatus(), absl::InternalError("a"), absl::FailedPreconditionError("b")});
  EXPECT_TRUE(absl::IsInternal(one)) << one;
  EXPECT_THAT(one.message(), HasSubstr("installed on server 0, but servers 1,2 did not confirm it (a)"));
}

}  // namespace
}  // namespace flatshard::client_internal
