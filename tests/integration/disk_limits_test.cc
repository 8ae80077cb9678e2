// Saves and exports that run out of room (here: a process's file size limit, which fails
// writes with EFBIG as a full disk fails them with ENOSPC) against real server processes:
// the caller gets RESOURCE_EXHAUSTED naming the file, no half-written checkpoint or file
// is left behind, earlier ones are untouched, and the servers train on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/checkpoint_kind.h"
#include "core/file.h"
#include "tests/file_size_limit.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// 16 MiB of fp32 parameters: 8 MiB per server of two, far past kFileSizeLimit.
constexpr int64_t kElements = int64_t{4} << 20;
constexpr rlim_t kFileSizeLimit = 1 << 20;

// Every name in `dir`, hidden ones included.
std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}

std::unique_ptr<Client> Worker(const testing::TestCluster& cluster) {
  absl::StatusOr<std::unique_ptr<Client>> client = cluster.Connect(0, 1);
  EXPECT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->ConfigureJob({}).ok());
  EXPECT_TRUE((*client)->RegisterGroup("w", {{"w", {kElements}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
  EXPECT_TRUE((*client)->InitGroupFromSeed("w", 5).ok());
  return std::move(*client);
}

// One training step of the one-worker job: the servers still serve.
void ExpectAStep(Client& client) {
  const absl::StatusOr<int64_t> version = client.WaitVersion("w", 0);
  ASSERT_TRUE(version.ok()) << version.status();
  const std::vector<float> grad(kElements, 0.5f);
  const absl::Status stepped = client.Scatter("w", *version, DType::kFloat32, AsBytes(grad)).get();
  ASSERT_TRUE(stepped.ok()) << stepped;
  EXPECT_EQ(*client.WaitVersion("w", *version + 1), *version + 1);
}

// The checkpoints listed, by name.
std::vector<std::string> Listed(Client& client) {
  std::vector<std::string> names;
  const absl::StatusOr<std::vector<CheckpointEntry>> list = client.ListCheckpoints();
  EXPECT_TRUE(list.ok()) << list.status();
  for (const CheckpointEntry& entry : list.value_or(std::vector<CheckpointEntry>())) names.push_back(entry.name);
  return names;
}

// Server 1 cannot write its part (server 0 can, and writes a larger share meanwhile): the
// save fails with server 1's error, and whichever server finishes last removes the save.
TEST(DiskLimitsTest, ASavePastOneServersFileSizeLimitFailsAndLeavesNothing) {
  const testing::ScratchDir root("disk-limits-one");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  {
    const testing::ScopedFileSizeLimit limit(kFileSizeLimit);
    cluster.Restart(1);  // server 1 alone under the limit
  }
  std::unique_ptr<Client> client = Worker(cluster);
  for (const CheckpointKind kind : {CheckpointKind::kFull, CheckpointKind::kSharded, CheckpointKind::kLocal}) {
    const absl::Status saved = client->SaveCheckpoint("step-0", kind, true);
    EXPECT_TRUE(absl::IsResourceExhausted(saved)) << saved;
    // At the file's open, before any of it is written: allocating a file of its own, or
    // checking the room for a FULL file that both servers fill.
    EXPECT_THAT(std::string(saved.message()),
                AllOf(HasSubstr("File too large"), AnyOf(HasSubstr("reserve"), HasSubstr("file size limit"))));
    EXPECT_THAT(Listing(root.path()), ElementsAre(".flatshard-root-id")) << CheckpointKindName(kind);
  }
  EXPECT_THAT(Listed(*client), IsEmpty());
  ExpectAStep(*client);
}

// Both servers fail, each streaming nothing further: the second to fail removes the save.
// Over roots of their own, server 1's FULL part goes to server 0's root, where server 0
// writes it and fails; over one root, each fails on its own part.
TEST(DiskLimitsTest, ASaveEveryServerFailsLeavesNothingWhetherRootsAreSharedOrNot) {
  const testing::ScratchDir shared("disk-limits-shared");
  const testing::ScratchDir own_0("disk-limits-own-0"), own_1("disk-limits-own-1");
  for (const bool roots_shared : {true, false}) {
    std::optional<testing::TestCluster> cluster;
    {
      const testing::ScopedFileSizeLimit limit(kFileSizeLimit);  // inherited by both servers
      cluster.emplace(2, "tok", ::testing::TempDir(), roots_shared ? shared.path() : "",
                      roots_shared ? std::vector<std::vector<std::string>>{}
                                   : std::vector<std::vector<std::string>>{{"--checkpoint_root=" + own_0.path()},
                                                                           {"--checkpoint_root=" + own_1.path()}});
    }
    std::unique_ptr<Client> client = Worker(*cluster);
    const absl::Status saved = client->SaveCheckpoint("step-0", CheckpointKind::kFull, true);
    EXPECT_TRUE(absl::IsResourceExhausted(saved)) << saved;
    for (const std::string& root : roots_shared ? std::vector<std::string>{shared.path()}
                                                : std::vector<std::string>{own_0.path(), own_1.path()}) {
      EXPECT_THAT(Listing(root), ElementsAre(".flatshard-root-id")) << root;
    }
    ExpectAStep(*client);
  }
}

// An async save returns once the cut is taken; the failure comes later, in the servers'
// logs, and then the save goes.
TEST(DiskLimitsTest, AnAsyncSaveThatFailsIsRemovedOnceEveryServerIsDone) {
  const testing::ScratchDir root("disk-limits-async");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  {
    const testing::ScopedFileSizeLimit limit(kFileSizeLimit);
    cluster.Restart(1);
  }
  std::unique_ptr<Client> client = Worker(cluster);
  ASSERT_TRUE(client->SaveCheckpoint("step-0", CheckpointKind::kSharded, true, /*async=*/true).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (Listing(root.path()).size() > 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_THAT(Listing(root.path()), ElementsAre(".flatshard-root-id"));
  EXPECT_THAT(Listed(*client), IsEmpty());
  ExpectAStep(*client);
}

// The exporting process's own limit: the export fails naming the file, and the directory
// keeps the earlier export's files as they were, with nothing of the failed one.
TEST(DiskLimitsTest, AnExportPastTheCallersFileSizeLimitKeepsTheEarlierExport) {
  const testing::ScratchDir out("disk-limits-export");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  std::unique_ptr<Client> client = Worker(cluster);
  ASSERT_TRUE(client->ExportStateDict(out.path(), CheckpointKind::kFull, false).ok());
  const std::string before = *ReadFileToString(out.path() + "/model.safetensors");
  ExpectAStep(*client);

  absl::Status exported;
  {
    const testing::ScopedFileSizeLimit limit(kFileSizeLimit);
    exported = client->ExportStateDict(out.path(), CheckpointKind::kFull, true);
  }
  EXPECT_TRUE(absl::IsResourceExhausted(exported)) << exported;
  EXPECT_THAT(std::string(exported.message()), AllOf(HasSubstr("reserve"), HasSubstr("File too large")));
  EXPECT_THAT(Listing(out.path()), ElementsAre("model.safetensors"));
  EXPECT_EQ(*ReadFileToString(out.path() + "/model.safetensors"), before);
  ExpectAStep(*client);
}

}  // namespace
}  // namespace flatshard
