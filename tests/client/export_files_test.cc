// ExportFiles: files take their names only when published, whole; anything else leaves
// the directory as it was. The tests that hold for both kinds of temporary file run with
// each (unnamed files, and named ones as where the file system has no unnamed files).
#include "client/export_files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/scratch_dir.h"

namespace flatshard::client_internal {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

v1::ExportChunk Chunk(const std::string& file, uint64_t size, uint64_t offset, const std::string& data, bool close) {
  v1::ExportChunk chunk;
  chunk.set_file(file);
  chunk.set_file_size(size);
  chunk.set_offset(offset);
  chunk.set_data(data);
  chunk.set_close(close);
  return chunk;
}

std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}

std::string Contents(const std::string& path) { return *ReadFileToString(path); }

using Temporaries = ExportFiles::Temporaries;

class ExportFilesTest : public ::testing::TestWithParam<Temporaries> {};

INSTANTIATE_TEST_SUITE_P(BothKinds, ExportFilesTest,
                         ::testing::Values(Temporaries::kUnnamedWherePossible, Temporaries::kNamed),
                         [](const auto& info) {
                           return info.param == Temporaries::kNamed ? std::string("Named") : std::string("Unnamed");
                         });

TEST_P(ExportFilesTest, TwoStreamsFillOneFileThatTakesItsNameWhenPublished) {
  const testing::ScratchDir dir("export-files-publish");
  ExportFiles files(dir.path(), GetParam());
  // Two servers' streams, each with its half of model.safetensors; one also sends an index.
  std::thread second([&] { ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors", 8, 4, "efgh", true)).ok()); });
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors", 8, 0, "ab", false)).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors", 8, 2, "cd", true)).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors.index.json", 2, 0, "{}", true)).ok());
  second.join();
  // Nothing under its own name before the export is published; unnamed files not at all.
  for (const std::string& name : Listing(dir.path())) EXPECT_EQ(name[0], '.') << name;
  if (GetParam() == Temporaries::kUnnamedWherePossible) {
    EXPECT_THAT(Listing(dir.path()), IsEmpty());
  }

  ASSERT_TRUE(files.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), ElementsAre("model.safetensors", "model.safetensors.index.json"));
  EXPECT_EQ(Contents(dir.path() + "/model.safetensors"), "abcdefgh");
  EXPECT_EQ(Contents(dir.path() + "/model.safetensors.index.json"), "{}");
}

TEST_P(ExportFilesTest, AnExportNeverPublishedRemovesItsFilesAndKeepsEarlierOnes) {
  const testing::ScratchDir dir("export-files-failed");
  {
    ExportFiles earlier(dir.path(), GetParam());
    ASSERT_TRUE(earlier.WriteChunk(Chunk("model.safetensors", 3, 0, "old", true)).ok());
    ASSERT_TRUE(earlier.Publish().ok());
  }
  {
    ExportFiles failed(dir.path(), GetParam());
    ASSERT_TRUE(failed.WriteChunk(Chunk("model.safetensors", 6, 0, "new", false)).ok());
    ASSERT_TRUE(failed.WriteChunk(Chunk("optimizer.safetensors", 6, 0, "opt", false)).ok());
    // A stream failed here: the export is destroyed unpublished, its files still open.
  }
  EXPECT_THAT(Listing(dir.path()), ElementsAre("model.safetensors"));
  EXPECT_EQ(Contents(dir.path() + "/model.safetensors"), "old");
}

TEST_P(ExportFilesTest, AnExportReplacesTheEarlierExportsFilesAndNothingElse) {
  const testing::ScratchDir dir("export-files-replace");
  // An earlier FULL export in one model file, with a split optimizer, and a SHARDED one
  // of 4 servers; beside them files and a directory of the user's.
  const std::vector<std::string> earlier = {"model.safetensors",
                                            "optimizer-00001-of-00002.safetensors",
                                            "optimizer-00002-of-00002.safetensors",
                                            "optimizer.safetensors.index.json",
                                            "shard-0.safetensors",
                                            "shard-3.safetensors"};
  const std::vector<std::string> users = {"notes.txt",
                                          "model.bin",
                                          "shard-x.safetensors",
                                          "shard-.safetensors",
                                          "shard-03.safetensors",  // no export names a shard so
                                          "shard-+3.safetensors",
                                          "model-1-of-2.safetensors",
                                          "model-00001-of-0000x.safetensors",
                                          "optimizer-00001-of-00002.safetensors.bak",
                                          "model.safetensors.bak",
                                          "my-model.safetensors",
                                          ".model.safetensors.partial-0123456789abcdef"};
  for (const std::string& name : earlier) std::ofstream(dir.path() + "/" + name) << "old";
  for (const std::string& name : users) std::ofstream(dir.path() + "/" + name) << "mine";
  fs::create_directory(dir.path() + "/shard-7.safetensors");

  ExportFiles files(dir.path(), GetParam());  // a FULL export, its model in two files
  ASSERT_TRUE(files.WriteChunk(Chunk("model-00001-of-00002.safetensors", 1, 0, "a", true)).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model-00002-of-00002.safetensors", 1, 0, "b", true)).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors.index.json", 2, 0, "{}", true)).ok());
  ASSERT_TRUE(files.Publish().ok());

  std::set<std::string> expected = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                    "model.safetensors.index.json", "shard-7.safetensors"};
  expected.insert(users.begin(), users.end());
  EXPECT_EQ(Listing(dir.path()), expected);
  for (const std::string& name : users) EXPECT_EQ(Contents(dir.path() + "/" + name), "mine") << name;
}

// Makes `path` look untouched for longer than an export waits before it takes another's
// unlocked file for a dead export's.
void Age(const std::string& path) {
  fs::last_write_time(path, fs::file_time_type::clock::now() - absl::ToChronoSeconds(2 * ExportFiles::kAbandonedAfter));
}

// The temporary files in `dir`.
std::vector<std::string> TemporaryFiles(const std::string& dir) {
  std::vector<std::string> names;
  for (const std::string& name : Listing(dir)) {
    if (absl::StrContains(name, ".partial-")) names.push_back(name);
  }
  return names;
}

// Forks a child that begins an export into `dir`, with a file half-written, and is
// killed; returns once it is dead.
void KillAnExportMidWay(const std::string& dir, Temporaries temporaries) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ExportFiles files(dir, temporaries);
    if (!files.WriteChunk(Chunk("model.safetensors", 8, 0, "abcd", false)).ok()) _exit(1);
    raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
}

TEST(ExportFilesUnnamedTest, AnExportWhoseProcessDiedLeavesNothing) {
  const testing::ScratchDir dir("export-files-killed-unnamed");
  KillAnExportMidWay(dir.path(), Temporaries::kUnnamedWherePossible);
  EXPECT_THAT(Listing(dir.path()), IsEmpty());
}

TEST(ExportFilesNamedTest, AnExportRemovesTheFilesOfAnExportWhoseProcessDied) {
  const testing::ScratchDir dir("export-files-killed");
  KillAnExportMidWay(dir.path(), Temporaries::kNamed);
  const std::vector<std::string> left = TemporaryFiles(dir.path());
  ASSERT_EQ(left.size(), 1u);
  Age(dir.path() + "/" + left[0]);

  ExportFiles next(dir.path(), Temporaries::kNamed);
  ASSERT_TRUE(next.WriteChunk(Chunk("model.safetensors", 3, 0, "new", true)).ok());
  ASSERT_TRUE(next.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), ElementsAre("model.safetensors"));
}

TEST(ExportFilesNamedTest, ARunningExportsFilesStayEvenWhenItStalls) {
  const testing::ScratchDir dir("export-files-running");
  // An export still running (its file locked), stalled for longer than kAbandonedAfter.
  auto running = std::make_unique<ExportFiles>(dir.path(), Temporaries::kNamed);
  ASSERT_TRUE(running->WriteChunk(Chunk("model.safetensors", 8, 0, "abcd", false)).ok());
  const std::vector<std::string> running_files = TemporaryFiles(dir.path());
  ASSERT_EQ(running_files.size(), 1u);
  Age(dir.path() + "/" + running_files[0]);
  // Unlocked, but new: an export that has just created it and not yet locked it.
  const std::string fresh = ".optimizer.safetensors.partial-00000000cafef00d";
  std::ofstream(dir.path() + "/" + fresh) << "fresh";
  // Not an export's temporary name: the user's.
  const std::string users = ".model.safetensors.partial-mine";
  std::ofstream(dir.path() + "/" + users) << "mine";
  Age(dir.path() + "/" + users);

  ExportFiles next(dir.path());
  ASSERT_TRUE(next.WriteChunk(Chunk("shard-0.safetensors", 3, 0, "new", true)).ok());
  ASSERT_TRUE(next.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), UnorderedElementsAre(users, fresh, running_files[0], "shard-0.safetensors"));

  running.reset();  // the running export fails: it removes its own file
  EXPECT_THAT(Listing(dir.path()), UnorderedElementsAre(users, fresh, "shard-0.safetensors"));
}

TEST_P(ExportFilesTest, FileNamesOutsideTheDirectoryOrHiddenAreRefused) {
  const testing::ScratchDir dir("export-files-names");
  ExportFiles files(dir.path(), GetParam());
  for (const std::string name : {"", "../model.safetensors", "sub/model.safetensors", ".model.safetensors"}) {
    const absl::Status written = files.WriteChunk(Chunk(name, 1, 0, "x", true));
    EXPECT_TRUE(absl::IsDataLoss(written)) << name << ": " << written;
  }
  ASSERT_TRUE(files.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), IsEmpty());
}

}  // namespace
}  // namespace flatshard::client_internal
