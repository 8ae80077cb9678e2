#include "core/layout_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace flatshard {
namespace {

using ::testing::HasSubstr;

TEST(LayoutJsonTest, PrintsThePublicFields) {
  absl::StatusOr<FlatLayout> layout = ParseLayoutSpecJson(R"({
      "servers": 3, "align": 0,
      "tensors": [{"name": "fc.weight", "shape": [4, 3], "dtype": "float32"},
                  {"name": "fc.bias", "shape": [4]}]})");
  ASSERT_TRUE(layout.ok()) << layout.status();
  const nlohmann::json json = nlohmann::json::parse(LayoutToJson(*layout));
  EXPECT_EQ(json["unpadded_numel"], 16);
  EXPECT_EQ(json["shard_numel"], 6);
  EXPECT_EQ(json["padded_numel"], 18);
  EXPECT_EQ(json["tensors"][1]["offset"], 12);
  EXPECT_EQ(json["tensors"][1]["numel"], 4);
  EXPECT_EQ(json["tensors"][1]["dtype"], "float32");
  const nlohmann::json& last = json["shards"][2];
  EXPECT_EQ(last["rank"], 2);
  EXPECT_EQ(last["start"], 12);
  EXPECT_EQ(last["end"], 16);
  EXPECT_EQ(last["padding"], 2);
  EXPECT_EQ(last["params"][0], (nlohmann::json{{"name", "fc.weight"}, {"in_shard", false}}));
  EXPECT_EQ(last["params"][1]["in_shard"], true);
  EXPECT_EQ(last["params"][1]["offset_in_shard"], 0);
  EXPECT_EQ(last["params"][1]["numel_in_shard"], 4);
  EXPECT_EQ(last["params"][1]["intra_param_start_idx"], 0);
  EXPECT_EQ(last["params"][1]["intra_param_end_idx"], 3);
}

void ExpectError(const char* text, const std::string& part) {
  absl::StatusOr<FlatLayout> layout = ParseLayoutSpecJson(text);
  ASSERT_FALSE(layout.ok()) << text;
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr(part)) << text;
}

TEST(LayoutJsonTest, ErrorsNameTheField) {
  ExpectError("{", "malformed JSON");
  ExpectError(R"({"servers": 1e999, "tensors": []})", "malformed JSON");  // out_of_range, not parse_error
  ExpectError("[]", "spec: must be a JSON object");
  ExpectError(R"({"tensors": []})", "servers: missing");
  ExpectError(R"({"servers": "2", "tensors": []})", "servers: must be an integer");
  ExpectError(R"({"servers": 0, "tensors": []})", "servers: 0");
  ExpectError(R"({"servers": 2})", "tensors: missing");
  ExpectError(R"({"servers": 2, "tensors": []})", "tensors: the list is empty");
  ExpectError(R"({"servers": 2, "tensors": [{"shape": [1]}]})", "tensors[0].name");
  ExpectError(R"({"servers": 2, "tensors": [{"name": "a"}]})", "tensors[0].shape");
  ExpectError(R"({"servers": 2, "tensors": [{"name": "a", "shape": [1.5]}]})",
              "tensors[0].shape[0]: must be an integer");
  ExpectError(R"({"servers": 2, "tensors": [{"name": "a", "shape": [1], "dtype": "fp8"}]})",
              "tensors[0].dtype: unknown dtype 'fp8'");
  ExpectError(R"({"servers": 2, "align": -1, "tensors": [{"name": "a", "shape": [1]}]})",
              "align: -1");
}

}  // namespace
}  // namespace flatshard
