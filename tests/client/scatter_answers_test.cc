#include "client/scatter_answers.h"

#include <gtest/gtest.h>

namespace flatshard::client_internal {
namespace {

TEST(ScatterAnswersTest, AStepIsReachedWhenEveryServerAnsweredTheVersionAfterIt) {
  ScatterAnswers answers;
  EXPECT_FALSE(answers.Reached({"a"}, 1)) << "nothing sent";
  const uint64_t a = answers.Begin("a", 0);
  EXPECT_FALSE(answers.Reached({"a"}, 1)) << "not answered yet";
  answers.Answered("a", a, 1);
  EXPECT_TRUE(answers.Reached({"a"}, 1));
  EXPECT_FALSE(answers.Reached({"a"}, 2)) << "a later version";
  EXPECT_FALSE(answers.Reached({"a"}, 0)) << "an earlier version: the servers say where they are";
  EXPECT_FALSE(answers.Reached({"a", "b"}, 1)) << "'b' was never sent";
  answers.Answered("b", answers.Begin("b", 0), 1);
  EXPECT_TRUE(answers.Reached({"a", "b"}, 1));
}

// Only the answer that says "this gradient completed the step" counts: a server still
// waiting for other workers answers the step itself, a load that moved the group another.
TEST(ScatterAnswersTest, OnlyTheVersionRightAfterTheStepCounts) {
  ScatterAnswers answers;
  answers.Answered("waiting", answers.Begin("waiting", 4), 4);
  EXPECT_FALSE(answers.Reached({"waiting"}, 5));
  answers.Answered("moved", answers.Begin("moved", 4), 9);
  EXPECT_FALSE(answers.Reached({"moved"}, 5));
  EXPECT_FALSE(answers.Reached({"moved"}, 9)) << "step 4 does not make version 9";
}

// A new send of the group (the next step, or a retry) voids what was known until it is
// answered, and an answer to an older send does not count for it.
TEST(ScatterAnswersTest, ANewSendVoidsTheOldAnswerAndIgnoresTheOldSendsLateOne) {
  ScatterAnswers answers;
  const uint64_t first = answers.Begin("a", 3);
  answers.Answered("a", first, 4);
  const uint64_t retry = answers.Begin("a", 3);
  EXPECT_FALSE(answers.Reached({"a"}, 4)) << "the retry is not answered yet";
  answers.Answered("a", first, 4);  // late: from the first send
  EXPECT_FALSE(answers.Reached({"a"}, 4));
  answers.Answered("a", retry, 4);
  EXPECT_TRUE(answers.Reached({"a"}, 4));
}

TEST(ScatterAnswersTest, ForgetVoidsEveryAnswerAndThoseStillToCome) {
  ScatterAnswers answers;
  answers.Answered("a", answers.Begin("a", 0), 1);
  const uint64_t in_flight = answers.Begin("b", 0);
  answers.Forget();
  EXPECT_FALSE(answers.Reached({"a"}, 1));
  answers.Answered("b", in_flight, 1);
  EXPECT_FALSE(answers.Reached({"b"}, 1)) << "sent before the load";
}

}  // namespace
}  // namespace flatshard::client_internal
