#include "client/sent_steps.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace flatshard::client_internal {
namespace {

using Steps = std::map<std::string, int64_t>;

TEST(SentStepsTest, BetweenStepsItNamesEachGroupsLatestStep) {
  SentSteps sent;
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  sent.Record("a", 0);
  sent.Record("b", 4);  // another version offset: registered later, say
  EXPECT_EQ(sent.AtBoundary(), (Steps{{"a", 0}, {"b", 4}}));
  sent.Record("a", 1);  // inside the next step
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  sent.Record("a", 1);  // a retry is the same step
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  sent.Record("b", 5);
  EXPECT_EQ(sent.AtBoundary(), (Steps{{"a", 1}, {"b", 5}}));
}

TEST(SentStepsTest, AGroupRegisteredButNotYetSentIsInsideTheFirstStep) {
  SentSteps sent;
  sent.Register("a");
  sent.Register("b");
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  EXPECT_FALSE(sent.InsideStep());  // nothing sent: not training (yet)
  sent.Record("a", 0);
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  EXPECT_TRUE(sent.InsideStep());
  sent.Record("b", 0);
  EXPECT_EQ(sent.AtBoundary(), (Steps{{"a", 0}, {"b", 0}}));
  EXPECT_FALSE(sent.InsideStep());
  sent.Register("a");  // registering again changes nothing
  EXPECT_EQ(sent.AtBoundary(), (Steps{{"a", 0}, {"b", 0}}));
}

TEST(SentStepsTest, AStepBackIsANewStepAndForgetStartsOver) {
  SentSteps sent;
  sent.Record("a", 9);
  sent.Record("b", 9);
  sent.Record("a", 3);  // after a load moved the versions back
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  sent.Record("b", 3);
  EXPECT_EQ(sent.AtBoundary(), (Steps{{"a", 3}, {"b", 3}}));
  sent.Forget();
  EXPECT_EQ(sent.AtBoundary(), Steps{});
  EXPECT_FALSE(sent.InsideStep());
  sent.Record("b", 4);
  EXPECT_EQ(sent.AtBoundary(), Steps{});  // "a" is still trained
  EXPECT_TRUE(sent.InsideStep());
  sent.Record("a", 4);
  EXPECT_EQ(sent.AtBoundary(), (Steps{{"a", 4}, {"b", 4}}));
}

}  // namespace
}  // namespace flatshard::client_internal
