// ExportFiles: files take their names only when published, whole; anything else leaves
// the directory as it was.
#include "client/export_files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/scratch_dir.h"

namespace flatshard::client_internal {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

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
