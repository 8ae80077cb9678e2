// TlsFiles (server/tls_files.h): a renewed pair becomes the current one and the watched
// file's content, modified later; a pair that does not go together and a file that
// cannot be read leave the last good pair.
#include "server/tls_files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "tests/scratch_dir.h"
#include "tests/test_certificates.h"

namespace flatshard::server {
namespace {

std::string ReadFile(const std::string& path) { return ReadFileToString(path).value_or(""); }

time_t Modified(const std::string& path) {
  struct stat info {};
  EXPECT_EQ(stat(path.c_str(), &info), 0) << path;
  return info.st_mtime;
}

TEST(TlsFilesTest, ARenewedPairIsTakenAndOneThatDoesNotGoTogetherIsNot) {
  const testing::ScratchDir dir("tls-files");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  std::filesystem::copy_file(file("server.pem"), file("cert.pem"));
  std::filesystem::copy_file(file("server.key"), file("key.pem"));
  const TlsOptions tls{.cert_chain = ReadFile(file("cert.pem")),
                       .private_key = ReadFile(file("key.pem")),
                       .root_certs = "",
                       .cert_file = file("cert.pem"),
                       .key_file = file("key.pem"),
                       .reload_interval = absl::Hours(1)};  // the test reloads by hand
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  const std::string watched = (*files)->watched_path();
  EXPECT_EQ(ReadFile(watched), tls.private_key + "\n" + tls.cert_chain);
  EXPECT_EQ((*files)->generation(), 0u);
  EXPECT_FALSE((*files)->Reload()) << "nothing changed";
  const time_t first = Modified(watched);

  std::filesystem::copy_file(file("server2.pem"), file("cert.pem"), std::filesystem::copy_options::overwrite_existing);
  EXPECT_FALSE((*files)->Reload()) << "the certificate renewed before its key";
  EXPECT_EQ((*files)->current().cert_chain, tls.cert_chain);
  EXPECT_EQ(ReadFile(watched), tls.private_key + "\n" + tls.cert_chain);

  std::filesystem::copy_file(file("server2.key"), file("key.pem"), std::filesystem::copy_options::overwrite_existing);
  EXPECT_TRUE((*files)->Reload());
  EXPECT_EQ((*files)->generation(), 1u);
  EXPECT_EQ((*files)->current().cert_chain, ReadFile(file("server2.pem")));
  EXPECT_EQ(ReadFile(watched), ReadFile(file("server2.key")) + "\n" + ReadFile(file("server2.pem")));
  EXPECT_GT(Modified(watched), first) << "a watcher could not tell the files apart";

  std::filesystem::remove(file("key.pem"));
  EXPECT_FALSE((*files)->Reload()) << "a key file that is gone";
  EXPECT_EQ((*files)->generation(), 1u);
}

}  // namespace
}  // namespace flatshard::server
