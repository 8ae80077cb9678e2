// Client::GatherGroups and ScatterGroups on real servers: a model of many groups, most
// small enough to go in pipelines and one too large for them, trained with AdamW by one
// client through the calls for many groups and by another, in a job of its own, one
// group at a time, reaches the same bits in every dtype; a group that is not registered
// fails in its own slot only; answers a server holds back in a pipeline never wait behind
// a wait.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

using testing::TestCluster;

constexpr int kGroups = 24;
constexpr int kSteps = 3;

// Group k: 100 * (k + 1) + 3 elements; the last one 50000 (25000 per server: 100 KB, more
// than a pipeline takes).
int64_t Numel(int k) { return k == kGroups - 1 ? 50000 : 100 * (k + 1) + 3; }

std::vector<std::string> GroupNames() {
  std::vector<std::string> names;
  for (int k = 0; k < kGroups; ++k) names.push_back(absl::StrCat("layer", k));
  return names;
}

// Registers and seeds the groups of job `job`.
absl::StatusOr<std::unique_ptr<Client>> Model(const TestCluster& cluster, const std::string& job,
                                              std::vector<const FlatLayout*>& layouts) {
  auto client = cluster.Connect({.job = job, .timeout = absl::Seconds(20)});
  if (!client.ok()) return client.status();
  if (absl::Status configured = (*client)->ConfigureJob({}); !configured.ok()) return configured;
  std::vector<GroupSpec> specs;
  for (int k = 0; k < kGroups; ++k) {
    specs.push_back({GroupNames()[k], {{"w", {Numel(k)}, DType::kFloat32}}, 0,
                     AdamOptions{.lr = 1e-2, .weight_decay = 0.1, .decoupled_weight_decay = true}});
  }
  absl::StatusOr<std::vector<const FlatLayout*>> registered = (*client)->RegisterGroups(std::move(specs));
  if (!registered.ok()) return registered.status();
  layouts = *registered;
  for (int k = 0; k < kGroups; ++k) {
    if (absl::Status seeded = (*client)->InitGroupFromSeed(GroupNames()[k], 100 + k); !seeded.ok()) return seeded;
  }
  return client;
}

// A gradient that depends on the parameters and the step, the same for both clients.
void GradientOf(const std::vector<float>& params, int step, std::vector<float>& grad) {
  grad.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) grad[i] = 0.5f * params[i] - 0.01f * static_cast<float>(step + i % 7);
}

TEST(ManyGroupsTest, TrainedThroughTheCallsForManyGroupsTheyReachTheBitsOfOneAtATime) {
  TestCluster cluster(2, "many-token", ::testing::TempDir());
  std::vector<const FlatLayout*> many_layouts, one_layouts;
  auto many = Model(cluster, "many", many_layouts);
  auto one = Model(cluster, "one", one_layouts);
  ASSERT_TRUE(many.ok() && one.ok()) << many.status() << one.status();
  const std::vector<std::string> names = GroupNames();
  std::vector<std::vector<float>> many_params(kGroups), one_params(kGroups), grads(kGroups);
  for (int k = 0; k < kGroups; ++k) {
    many_params[k].assign(many_layouts[k]->padded_numel(), -1.0f);
    one_params[k].assign(one_layouts[k]->padded_numel(), -1.0f);
  }
  for (int step = 0; step < kSteps; ++step) {
    std::vector<absl::Span<std::byte>> outs;
    for (auto& params : many_params) outs.push_back(AsBytes(params));
    std::vector<std::future<absl::StatusOr<int64_t>>> gathered =
        (*many)->GatherGroups(names, step, DType::kFloat32, outs);
    ASSERT_EQ(gathered.size(), names.size());
    for (int k = 0; k < kGroups; ++k) {
      absl::StatusOr<int64_t> version = gathered[k].get();
      ASSERT_TRUE(version.ok()) << names[k] << ": " << version.status();
      EXPECT_EQ(*version, step);
      absl::StatusOr<int64_t> one_version = (*one)->Gather(names[k], step, DType::kFloat32,
                                                           AsBytes(one_params[k])).get();
      ASSERT_TRUE(one_version.ok()) << one_version.status();
      ASSERT_EQ(std::memcmp(many_params[k].data(), one_params[k].data(), many_params[k].size() * sizeof(float)), 0)
          << names[k] << " at step " << step;
      GradientOf(many_params[k], step, grads[k]);
    }
    std::vector<absl::Span<const std::byte>> sends;
    for (const auto& grad : grads) sends.push_back(AsBytes(grad));
    std::vector<std::future<absl::Status>> scattered = (*many)->ScatterGroups(names, step, DType::kFloat32, sends);
    for (int k = 0; k < kGroups; ++k) {
      const absl::Status status = scattered[k].get();
      ASSERT_TRUE(status.ok()) << names[k] << ": " << status;
      ASSERT_TRUE((*one)->Scatter(names[k], step, DType::kFloat32, AsBytes(grads[k])).get().ok());
    }
  }
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    std::vector<std::vector<std::byte>> a(kGroups), b(kGroups);
    std::vector<absl::Span<std::byte>> outs;
    for (int k = 0; k < kGroups; ++k) {
      a[k].assign(many_layouts[k]->padded_numel() * DTypeSize(dtype), std::byte{0xAA});
      b[k].assign(a[k].size(), std::byte{0x55});
      outs.push_back(absl::MakeSpan(a[k]));
    }
    std::vector<std::future<absl::StatusOr<int64_t>>> gathered = (*many)->GatherGroups(names, kSteps, dtype, outs);
    for (int k = 0; k < kGroups; ++k) {
      absl::StatusOr<int64_t> version = gathered[k].get();
      ASSERT_TRUE(version.ok()) << version.status();
      EXPECT_EQ(*version, kSteps);
      ASSERT_TRUE((*one)->Gather(names[k], kSteps, dtype, absl::MakeSpan(b[k])).get().ok());
      EXPECT_EQ(a[k], b[k]) << names[k] << " in " << DTypeName(dtype);
    }
  }
}

TEST(ManyGroupsTest, AGroupThatIsNotRegisteredFailsInItsOwnSlot) {
  TestCluster cluster(2, "many-token", ::testing::TempDir());
  std::vector<const FlatLayout*> layouts;
  auto client = Model(cluster, "slots", layouts);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<float> first(layouts[0]->padded_numel()), second(layouts[1]->padded_numel()), unknown(8);
  std::vector<std::future<absl::StatusOr<int64_t>>> gathered = (*client)->GatherGroups(
      {"layer0", "nope", "layer1"}, 0, DType::kFloat32, {AsBytes(first), AsBytes(unknown), AsBytes(second)});
  ASSERT_EQ(gathered.size(), 3u);
  EXPECT_TRUE(gathered[0].get().ok());
  const absl::StatusOr<int64_t> refused = gathered[1].get();
  EXPECT_TRUE(absl::IsNotFound(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("nope"), absl::string_view::npos) << refused.status();
  EXPECT_TRUE(gathered[2].get().ok());
  std::vector<std::future<absl::Status>> scattered =
      (*client)->ScatterGroups({"layer0", "layer1"}, 0, DType::kFloat32, {AsBytes(first)});
  for (auto& future : scattered) {
    const absl::Status status = future.get();
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_NE(status.message().find("2 groups but 1 buffers"), absl::string_view::npos) << status;
  }
}

// A server holds its answers to a pipeline back while the next request is already read,
// to send them together; never across a wait. Here layer1's gather waits for a version
// that comes only once this worker, having layer0's parameters, sends layer1's gradient:
// layer0's answer must not wait behind it.
TEST(ManyGroupsTest, AnAnswerHeldBackForTheNextInAPipelineGoesOutBeforeThatOneWaits) {
  TestCluster cluster(2, "many-token", ::testing::TempDir());
  std::vector<const FlatLayout*> layouts;
  auto client = Model(cluster, "held", layouts);
  ASSERT_TRUE(client.ok()) << client.status();
  Client& c = **client;
  std::vector<float> first(layouts[0]->padded_numel()), second(layouts[1]->padded_numel());
  const std::vector<float> grad_first(first.size(), 0.5f), grad_second(second.size(), 0.5f);
  ASSERT_TRUE(c.Scatter("layer0", 0, DType::kFloat32, AsBytes(grad_first)).get().ok());  // layer0 at 1
  std::vector<std::future<absl::StatusOr<int64_t>>> gathered =
      c.GatherGroups({"layer0", "layer1"}, 1, DType::kFloat32, {AsBytes(first), AsBytes(second)});
  ASSERT_EQ(gathered[0].wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "layer0's answer waited behind layer1's wait";
  EXPECT_EQ(gathered[0].get().value_or(-1), 1);
  EXPECT_EQ(gathered[1].wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  ASSERT_TRUE(c.Scatter("layer1", 0, DType::kFloat32, AsBytes(grad_second)).get().ok());
  EXPECT_EQ(gathered[1].get().value_or(-1), 1);
}

}  // namespace
}  // namespace flatshard
