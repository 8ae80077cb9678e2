// TakeShards pinning a cut on one server while the groups step: the groups cut at the
// cut's highest version are held there until every group is pinned, and a group cut
// lower is not held (its step may be what another group's progress needs).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "server/checkpoint_writer.h"
#include "server/registry.h"

namespace flatshard::server {
namespace {

// A one-worker job "job" with groups "g" and "h" (SGD), on server 0 of 1.
class TakeShardsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(registry_.ConfigureJob("job", {.num_workers = 1}).ok());
    for (const char* name : {"g", "h"}) {
      ASSERT_TRUE(
          registry_.RegisterGroup("job", name, {{"w", {4}, DType::kFloat32}}, 0, kernels::SgdHyperparams{.lr = 0.1f})
              .ok());
    }
  }

  // The worker's gradient of `group` for `step`.
  absl::Status Step(const std::string& group, int64_t step) {
    FLATSHARD_ASSIGN_OR_RETURN(std::shared_ptr<Group> found, registry_.FindGroup("job", group));
    FLATSHARD_ASSIGN_OR_RETURN(ReceiveSlot slot, found->BeginScatter(step, 0, DType::kFloat32));
    std::memset(slot.buffer.data(), 0, slot.buffer.size());
    return found->CommitScatter(slot).status();
  }

  int64_t Version(const std::string& group) { return (*registry_.FindGroup("job", group))->version(); }

  Registry registry_{/*rank=*/0, /*num_servers=*/1};
};

TEST_F(TakeShardsTest, GroupsAtTheCutAreHeldThereUntilEveryGroupIsPinned) {
  absl::StatusOr<std::vector<SavedShard>> shards;
  std::thread pinning([&] {
    shards = TakeShards(registry_, 0, "job", {{"g", 1}, {"h", 1}}, absl::InfiniteFuture(), /*pin=*/true);
  });
  absl::SleepFor(absl::Milliseconds(100));  // "g" is awaited
  EXPECT_TRUE(Step("h", 0).ok());
  std::thread stepping([&] { EXPECT_TRUE(Step("h", 1).ok()); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(Version("h"), 1);  // held at the cut while "g" gets there
  EXPECT_TRUE(Step("g", 0).ok());
  pinning.join();
  EXPECT_TRUE(shards.ok()) << shards.status();
  EXPECT_EQ(Version("h"), 1);  // now pinned
  if (shards.ok()) shards->clear();
  stepping.join();
  EXPECT_EQ(Version("h"), 2);
}

TEST_F(TakeShardsTest, AGroupCutLowerIsNotHeld) {
  absl::StatusOr<std::vector<SavedShard>> shards;
  std::thread pinning([&] {
    shards = TakeShards(registry_, 0, "job", {{"g", 1}, {"h", 0}}, absl::InfiniteFuture(), /*pin=*/true);
  });
  absl::SleepFor(absl::Milliseconds(100));  // "g" is awaited
  std::atomic<bool> stepped = false;
  std::thread stepping([&] {
    EXPECT_TRUE(Step("h", 0).ok());
    stepped = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_TRUE(stepped) << "'h' was held at 0, below the cut's highest version";
  EXPECT_TRUE(Step("g", 0).ok());
  pinning.join();
  if (shards.ok()) shards->clear();  // (held, "h" was pinned at 0: let it step)
  stepping.join();
  EXPECT_TRUE(absl::IsAborted(shards.status())) << shards.status();  // "h" moved past the cut: a later one follows
}

}  // namespace
}  // namespace flatshard::server
