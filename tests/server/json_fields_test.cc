// NonNegativeInteger: the integers a checkpoint's JSON may hold for a count, size, version
// or rank, and a clear DataLoss for everything nlohmann would otherwise convert.
#include "server/json_fields.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

TEST(JsonFieldsTest, NonNegativeIntegersAreReadAndEverythingElseIsDataLoss) {
  const auto parsed = [](const char* text) { return nlohmann::json::parse(text); };
  EXPECT_EQ(*NonNegativeInteger(parsed(R"({"v": 0})"), "v", 7, "m"), 0);
  EXPECT_EQ(*NonNegativeInteger(parsed(R"({"v": 12})"), "v", 7, "m"), 12);
  EXPECT_EQ(*NonNegativeInteger(parsed(R"({"v": 9223372036854775807})"), "v", 7, "m"),
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(*NonNegativeInteger(parsed(R"({"w": 1})"), "v", 7, "m"), 7);   // absent
  EXPECT_EQ(*NonNegativeInteger(parsed(R"([1, 2])"), "v", -1, "m"), -1);  // not an object: absent too
  for (const char* value : {"-1", "0.5", "1.0", "1e30", "-0.0", "9223372036854775808", "18446744073709551615",
                            "\"5\"", "null", "true", "[1]", "{}"}) {
    const absl::StatusOr<int64_t> read =
        NonNegativeInteger(parsed((std::string(R"({"v": )") + value + "}").c_str()), "v", 0, "checkpoint 'c'");
    ASSERT_FALSE(read.ok()) << value;
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << value;
    EXPECT_THAT(std::string(read.status().message()),
                HasSubstr("checkpoint 'c': \"v\" must be a non-negative integer, not "))
        << value;
  }
}

}  // namespace
}  // namespace flatshard::server
