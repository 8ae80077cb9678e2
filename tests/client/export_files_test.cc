// ExportFiles: files take their names only when published, whole; anything else leaves
// the directory as it was.
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

TEST(ExportFilesTest, TwoStreamsFillOneFileThatTakesItsNameWhenPublished) {
  const testing::ScratchDir dir("export-files-publish");
  ExportFiles files(dir.path());
  // Two servers' streams, each with its half of model.safetensors; one also sends an index.
  std::thread second([&] {
    std::map<std::string, File> open;
    ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors", 8, 4, "efgh", true), open).ok());
  });
  std::map<std::string, File> open;
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors", 8, 0, "ab", false), open).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors", 8, 2, "cd", true), open).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors.index.json", 2, 0, "{}", true), open).ok());
  second.join();
  // Nothing under its own name before the export is published.
  for (const std::string& name : Listing(dir.path())) EXPECT_EQ(name[0], '.') << name;

  ASSERT_TRUE(files.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), ElementsAre("model.safetensors", "model.safetensors.index.json"));
  EXPECT_EQ(Contents(dir.path() + "/model.safetensors"), "abcdefgh");
  EXPECT_EQ(Contents(dir.path() + "/model.safetensors.index.json"), "{}");
}

TEST(ExportFilesTest, AnExportNeverPublishedRemovesItsFilesAndKeepsEarlierOnes) {
  const testing::ScratchDir dir("export-files-failed");
  {
    ExportFiles earlier(dir.path());
    std::map<std::string, File> open;
    ASSERT_TRUE(earlier.WriteChunk(Chunk("model.safetensors", 3, 0, "old", true), open).ok());
    ASSERT_TRUE(earlier.Publish().ok());
  }
  {
    ExportFiles failed(dir.path());
    std::map<std::string, File> open;
    ASSERT_TRUE(failed.WriteChunk(Chunk("model.safetensors", 6, 0, "new", false), open).ok());
    ASSERT_TRUE(failed.WriteChunk(Chunk("optimizer.safetensors", 6, 0, "opt", false), open).ok());
    // A stream failed here: the export is destroyed unpublished, its files still open.
  }
  EXPECT_THAT(Listing(dir.path()), ElementsAre("model.safetensors"));
  EXPECT_EQ(Contents(dir.path() + "/model.safetensors"), "old");
}

TEST(ExportFilesTest, AnExportReplacesTheEarlierExportsFilesAndNothingElse) {
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
                                          "model-1-of-2.safetensors",
                                          "model-00001-of-0000x.safetensors",
                                          "optimizer-00001-of-00002.safetensors.bak",
                                          "model.safetensors.bak",
                                          "my-model.safetensors",
                                          ".model.safetensors.partial-0123456789abcdef"};
  for (const std::string& name : earlier) std::ofstream(dir.path() + "/" + name) << "old";
  for (const std::string& name : users) std::ofstream(dir.path() + "/" + name) << "mine";
  fs::create_directory(dir.path() + "/shard-7.safetensors");

  ExportFiles files(dir.path());  // a FULL export, its model in two files
  std::map<std::string, File> open;
  ASSERT_TRUE(files.WriteChunk(Chunk("model-00001-of-00002.safetensors", 1, 0, "a", true), open).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model-00002-of-00002.safetensors", 1, 0, "b", true), open).ok());
  ASSERT_TRUE(files.WriteChunk(Chunk("model.safetensors.index.json", 2, 0, "{}", true), open).ok());
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

TEST(ExportFilesTest, AnExportRemovesTheFilesOfAnExportWhoseProcessDied) {
  const testing::ScratchDir dir("export-files-killed");
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // an export that dies with a file half-written
    ExportFiles files(dir.path());
    std::map<std::string, File> open;
    if (!files.WriteChunk(Chunk("model.safetensors", 8, 0, "abcd", false), open).ok()) _exit(1);
    raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  const std::vector<std::string> left = TemporaryFiles(dir.path());
  ASSERT_EQ(left.size(), 1u);
  Age(dir.path() + "/" + left[0]);

  ExportFiles next(dir.path());
  std::map<std::string, File> open;
  ASSERT_TRUE(next.WriteChunk(Chunk("model.safetensors", 3, 0, "new", true), open).ok());
  ASSERT_TRUE(next.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), ElementsAre("model.safetensors"));
}

TEST(ExportFilesTest, ARunningExportsFilesStayEvenWhenItStalls) {
  const testing::ScratchDir dir("export-files-running");
  // An export still running (its file locked), stalled for longer than kAbandonedAfter.
  auto running = std::make_unique<ExportFiles>(dir.path());
  std::map<std::string, File> running_open;
  ASSERT_TRUE(running->WriteChunk(Chunk("model.safetensors", 8, 0, "abcd", false), running_open).ok());
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
  std::map<std::string, File> open;
  ASSERT_TRUE(next.WriteChunk(Chunk("shard-0.safetensors", 3, 0, "new", true), open).ok());
  ASSERT_TRUE(next.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), UnorderedElementsAre(users, fresh, running_files[0], "shard-0.safetensors"));

  running_open.clear();
  running.reset();  // the running export fails: it removes its own file
  EXPECT_THAT(Listing(dir.path()), UnorderedElementsAre(users, fresh, "shard-0.safetensors"));
}

TEST(ExportFilesTest, FileNamesOutsideTheDirectoryOrHiddenAreRefused) {
  const testing::ScratchDir dir("export-files-names");
  ExportFiles files(dir.path());
  std::map<std::string, File> open;
  for (const std::string name : {"", "../model.safetensors", "sub/model.safetensors", ".model.safetensors"}) {
    const absl::Status written = files.WriteChunk(Chunk(name, 1, 0, "x", true), open);
    EXPECT_TRUE(absl::IsDataLoss(written)) << name << ": " << written;
  }
  ASSERT_TRUE(files.Publish().ok());
  EXPECT_THAT(Listing(dir.path()), IsEmpty());
}

}  // namespace
}  // namespace flatshard::client_internal
