// tls::PublishedFile (tls/published_file.h): what a reader finds by its path is the last
// text published, each one modified at a later whole second than the one before.
#include "tls/published_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include "core/file.h"

namespace flatshard::tls {
namespace {

time_t Modified(const std::string& path) {
  struct stat info {};
  EXPECT_EQ(stat(path.c_str(), &info), 0) << path;
  return info.st_mtime;
}

TEST(PublishedFileTest, ReadersFindTheLastTextModifiedLater) {
  auto file = PublishedFile::Create("first");
  ASSERT_TRUE(file.ok()) << file.status();
  const std::string path = (*file)->path();
  EXPECT_EQ(ReadFileToString(path).value_or(""), "first");
  time_t before = Modified(path);
  for (const std::string text : {"second, longer than the first", "3", ""}) {
    ASSERT_TRUE((*file)->Publish(text).ok());
    EXPECT_EQ(ReadFileToString(path).value_or("?"), text);
    const time_t modified = Modified(path);
    EXPECT_GT(modified, before) << "published in the same second, yet a watcher must tell them apart";
    before = modified;
  }
}

}  // namespace
}  // namespace flatshard::tls
