// CertificatesDir: a gtest fixture whose test certificates (tests/test_certificates.h)
// lie in a scratch directory of its own, with helpers to name, read, copy and write the
// files there. For the tls/ tests.
//
//   class KeyPairTest : public testing::CertificatesDir {};
//   TEST_F(KeyPairTest, ...) { Use("client.pem", "cert.pem"); EXPECT_EQ(Read("cert.pem"), ...); }
#ifndef FLATSHARD_TESTS_TLS_CERTIFICATES_DIR_H_
#define FLATSHARD_TESTS_TLS_CERTIFICATES_DIR_H_

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "tests/scratch_dir.h"
#include "tests/test_certificates.h"

namespace flatshard::testing {

class CertificatesDir : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(MakeTestCertificates(dir_.path())) << "openssl could not make them"; }

  std::string File(const std::string& name) const { return absl::StrCat(dir_.path(), "/", name); }
  std::string Read(const std::string& name) const { return ReadFileToString(File(name)).value_or(""); }
  // Copies file `from` over file `to`.
  void Use(const std::string& from, const std::string& to) const {
    std::filesystem::copy_file(File(from), File(to), std::filesystem::copy_options::overwrite_existing);
  }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(File(name), std::ios::trunc) << text;
  }

 private:
  const ScratchDir dir_{"certificates"};
};

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_TLS_CERTIFICATES_DIR_H_
