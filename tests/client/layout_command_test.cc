#include "client/cli/layout_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tests/run_command.h"
#include "tests/scratch_dir.h"

namespace flatshard::cli {
namespace {

using ::testing::HasSubstr;

constexpr char kSpec[] = R"({"servers": 3, "align": 0, "tensors": [
    {"name": "fc.weight", "shape": [4, 3], "dtype": "float32"},
    {"name": "fc.bias", "shape": [4], "dtype": "float32"},
    {"name": "tiny", "shape": [], "dtype": "bfloat16"}]})";

TEST(LayoutCommandTest, TableShowsRangesMemoryAndTensors) {
  std::istringstream in(kSpec);
  std::ostringstream out, err;
  ASSERT_EQ(RunLayoutCommand({}, in, out, err), 0) << err.str();
  const std::string table = out.str();
  // U = 17, S = 6: server 2 holds all of fc.bias and tiny, padded by 1.
  EXPECT_THAT(table, HasSubstr("unpadded 17 elements, shard 6, padded 18"));
  EXPECT_THAT(table, HasSubstr("[12, 17)"));
  EXPECT_THAT(table, HasSubstr("  fc.weight[6:12]\n"));
  EXPECT_THAT(table, HasSubstr("  fc.bias[0:4] tiny[0:1]\n"));
  EXPECT_THAT(table, HasSubstr("24 B"));   // 6 fp32 parameters
  EXPECT_THAT(table, HasSubstr("48 B"));   // Adam: two moments
  EXPECT_TRUE(err.str().empty());
}

TEST(LayoutCommandTest, MemoryColumnsCountTheOptimizersState) {
  // Shards of 6 fp32 elements: 24 B per buffer; one fp32 worker's staging slot and an
  // fp32 snapshot, 24 B each.
  const struct {
    const char* optimizer;
    const char* grads;
    const char* state;
    const char* staging;
    const char* total;
  } cases[] = {{"adam", "24 B", "48 B", "24 B", "144 B"},
               {"sgd", "24 B", "0 B", "24 B", "96 B"},
               {"sgd-momentum", "24 B", "24 B", "24 B", "120 B"},
               {"frozen", "0 B", "0 B", "0 B", "48 B"}};
  for (const auto& c : cases) {
    std::istringstream in(kSpec);
    std::ostringstream out, err;
    ASSERT_EQ(RunLayoutCommand({.optimizer = c.optimizer}, in, out, err), 0) << err.str();
    const std::string table = out.str();
    EXPECT_THAT(table,
                HasSubstr(absl::StrFormat("%11s %11s %11s %11s %11s", "24 B", c.grads, c.state, c.staging, "24 B")))
        << c.optimizer;
    EXPECT_THAT(table, HasSubstr(absl::StrCat("per server: ", c.total, " (params + grads + ", c.optimizer)))
        << c.optimizer;
  }
  std::istringstream in(kSpec);
  std::ostringstream out, err;
  EXPECT_EQ(RunLayoutCommand({.optimizer = "lamb"}, in, out, err), 2);
  EXPECT_EQ(err.str(), "flatshard layout: --optimizer_kind=lamb: expected adam, adamw, sgd, sgd-momentum, frozen or average\n");
  EXPECT_TRUE(out.str().empty());
}

TEST(LayoutCommandTest, StagingCountsEveryWorkersGradientAndTheSnapshotTheGatherDtype) {
  // 6-element shards: 4 workers' bf16 gradients 48 B, an fp16 snapshot 12 B; with Adam's
  // 96 B, 156 B per server.
  std::istringstream in(kSpec);
  std::ostringstream out, err;
  ASSERT_EQ(RunLayoutCommand({.workers = 4, .grad_dtype = "bfloat16", .gather_dtype = "float16"}, in, out, err), 0)
      << err.str();
  EXPECT_THAT(out.str(),
              HasSubstr(absl::StrFormat("%11s %11s %11s %11s %11s", "24 B", "24 B", "48 B", "48 B", "12 B")));
  EXPECT_THAT(out.str(), HasSubstr("per server: 156 B (params + grads + adam state + staging + snapshot)"));

  const struct {
    LayoutCommandOptions options;
    const char* error;
  } refused[] = {
      {{.workers = 0}, "--workers=0: expected 1 or more"},
      {{.grad_dtype = "int8"}, "--grad_dtype=int8: expected float32, bfloat16 or float16"},
      {{.gather_dtype = "float64"}, "--gather_dtype=float64: expected float32, bfloat16 or float16"},
  };
  for (const auto& r : refused) {
    std::istringstream spec(kSpec);
    std::ostringstream table, message;
    EXPECT_EQ(RunLayoutCommand(r.options, spec, table, message), 2) << r.error;
    EXPECT_EQ(message.str(), absl::StrCat("flatshard layout: ", r.error, "\n"));
    EXPECT_TRUE(table.str().empty());
  }
}

TEST(LayoutCommandTest, AHybridJobsServersAlsoKeepTheExchangeBuffers) {
  // 6-element shards in 3 replica groups: chunks of 0, 4 and 2 elements (boundaries
  // rounded down to 4). A server keeps its fp32 partial of the shard (24 B) and the two
  // other replica groups' partials of its chunk: 0, 32 or 16 B.
  std::istringstream in(kSpec);
  std::ostringstream out, err;
  ASSERT_EQ(RunLayoutCommand({.replica_groups = 3}, in, out, err), 0) << err.str();
  EXPECT_THAT(out.str(), HasSubstr("hybrid: 3 replica groups of these 3 servers (9 servers in all)\n"));
  EXPECT_THAT(out.str(), HasSubstr(absl::StrFormat("%11s %11s %11s %11s %11s %11s", "24 B", "24 B", "48 B", "24 B",
                                                   "24 B", "56 B")));
  EXPECT_THAT(out.str(), HasSubstr("per server: 200 B (params + grads + adam state + staging + snapshot + exchange, "
                                   "at most)"));
  const auto buffers = BuffersFor({.replica_groups = 3});
  ASSERT_TRUE(buffers.ok());
  const absl::StatusOr<FlatLayout> layout = FlatLayout::Create({{"w", {17}, DType::kFloat32}}, 0, 3);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *buffers, 0), 24);
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *buffers, 1), 56);
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *buffers, 2), 40);
  EXPECT_EQ(PlannedBytesPerServer(*layout, *buffers, 2), 144 + 40);
  // The device tier's servers also keep the reduced gradient (24 B) in host memory; the
  // pinned tier's is its gradient.
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *BuffersFor({.replica_groups = 3, .memory = "device"}), 1), 56 + 24);
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *BuffersFor({.replica_groups = 3, .memory = "pinned"}), 1), 56);
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *BuffersFor({.memory = "device"}), 0), 0);
  // Frozen groups take no gradients: nothing to exchange.
  EXPECT_EQ(ExchangeBytesPerServer(*layout, *BuffersFor({.optimizer = "frozen", .replica_groups = 3}), -1), 0);

  std::istringstream spec(kSpec);
  std::ostringstream table, message;
  EXPECT_EQ(RunLayoutCommand({.replica_groups = 0}, spec, table, message), 2);
  EXPECT_EQ(message.str(), "flatshard layout: --replica_groups=0: expected 1 or more\n");
  EXPECT_EQ(BuffersFor({.memory = "gpu"}).status().message(), "--memory=gpu: expected host, pinned or device");
}

TEST(LayoutCommandTest, InvalidSpecExitsTwoWithOneLine) {
  std::istringstream in(R"({"servers": 2, "tensors": [{"name": "a", "shape": [-1]}]})");
  std::ostringstream out, err;
  EXPECT_EQ(RunLayoutCommand({}, in, out, err), 2);
  EXPECT_EQ(err.str(), "flatshard layout: tensors[0] 'a': dimension 0 is -1, must be >= 0\n");
  EXPECT_TRUE(out.str().empty());
}

// Runs the real binary: `sh -c` with the spec on stdin; returns (exit code, stdout).
std::pair<int, std::string> RunBinary(const std::string& args, const std::string& stdin_text) {
  // One file per test: ctest runs the tests of this binary in parallel.
  const std::string spec_path =
      testing::ScratchPath(absl::StrCat(::testing::UnitTest::GetInstance()->current_test_info()->name(), ".json"));
  std::ofstream(spec_path) << stdin_text;
  const std::string command = std::string(FLATSHARD_CLI_PATH) + " layout " + args + " < " +
                              spec_path + " 2>&1";
  return flatshard::testing::RunCommand(command);
}

TEST(LayoutBinaryTest, JsonFromStdin) {
  auto [code, output] = RunBinary("--json", kSpec);
  ASSERT_EQ(code, 0) << output;
  const nlohmann::json json = nlohmann::json::parse(output);
  EXPECT_EQ(json["padded_numel"], 18);
  EXPECT_EQ(json["shards"][2]["params"][2]["offset_in_shard"], 4);
}

TEST(LayoutBinaryTest, OptimizerKindFlagReachesTheTable) {
  auto [code, output] = RunBinary("--optimizer_kind=frozen", kSpec);
  ASSERT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("per server: 48 B (params + grads + frozen state + staging + snapshot)"));
  std::tie(code, output) = RunBinary("--workers=2 --grad_dtype=bfloat16", kSpec);
  ASSERT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("per server: 144 B (params + grads + adam state + staging + snapshot)"));
  std::tie(code, output) = RunBinary("--replica_groups=3", kSpec);
  ASSERT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("per server: 200 B (params + grads + adam state + staging + snapshot + exchange"));
  std::tie(code, output) = RunBinary("--replica_groups=3 --memory=device", kSpec);
  ASSERT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("per server: 224 B (params + grads + adam state + staging + snapshot + exchange"));
  EXPECT_EQ(RunBinary("--optimizer_kind=lamb", kSpec).first, 2);
}

TEST(LayoutBinaryTest, MalformedJsonExitsTwo) {
  auto [code, output] = RunBinary("-", "{\"servers\": 2,");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(output, HasSubstr("flatshard layout: malformed JSON"));
}

TEST(LayoutBinaryTest, MissingFileExitsTwo) {
  auto [code, output] = RunBinary("/nonexistent/spec.json", "");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(output, HasSubstr("cannot open '/nonexistent/spec.json'"));
}

}  // namespace
}  // namespace flatshard::cli
