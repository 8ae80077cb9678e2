#include "server/auth.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

namespace flatshard::server {
namespace {

TEST(AuthTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("s3cret-token", "s3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-token", "s3cret-tokeN"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-token", "X3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "s3cret-token"));  // a prefix is not a match
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST(AuthTest, SessionTokensAreFreshRandomHexAndOnlyIssuedOnesAreValid) {
  SessionTokens sessions;
  std::set<std::string> issued;
  for (int i = 0; i < 1000; ++i) {
    const std::string token = sessions.Issue();
    ASSERT_EQ(token.size(), 32u);
    ASSERT_EQ(token.find_first_not_of("0123456789abcdef"), std::string::npos) << token;
    issued.insert(token);
  }
  EXPECT_EQ(issued.size(), 1000u);
  for (const std::string& token : issued) EXPECT_TRUE(sessions.Valid(token));
  std::string forged = *issued.begin();
  forged[0] = forged[0] == '0' ? '1' : '0';
  EXPECT_EQ(sessions.Valid(forged), issued.count(forged) == 1);
  EXPECT_FALSE(sessions.Valid(""));
  EXPECT_FALSE(sessions.Valid(issued.begin()->substr(1)));
  EXPECT_FALSE(SessionTokens().Valid(*issued.begin()));  // per server
}

TEST(AuthTest, OnlyTheMostRecentSessionTokensStayValid) {
  SessionTokens sessions(3);
  std::vector<std::string> tokens;
  for (int i = 0; i < 5; ++i) tokens.push_back(sessions.Issue());
  EXPECT_FALSE(sessions.Valid(tokens[0]));
  EXPECT_FALSE(sessions.Valid(tokens[1]));
  for (int i = 2; i < 5; ++i) EXPECT_TRUE(sessions.Valid(tokens[i])) << i;
}

TEST(AuthTest, SessionTokensMayBeIssuedAndCheckedFromManyThreads) {
  SessionTokens sessions;
  std::vector<std::thread> threads;
  std::vector<std::vector<std::string>> tokens(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        tokens[t].push_back(sessions.Issue());
        EXPECT_TRUE(sessions.Valid(tokens[t].back()));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const auto& list : tokens) {
    for (const std::string& token : list) EXPECT_TRUE(sessions.Valid(token));
  }
}

}  // namespace
}  // namespace flatshard::server
