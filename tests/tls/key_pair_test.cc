// tls::KeyPair (tls/key_pair.h): a renewed pair is taken once both files are written; a
// certificate without its key, an expired one, one refused by its owner's check or files
// gone are not, and the last good pair stays published for gRPC's watchers.
#include "tls/key_pair.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "core/file.h"
#include "tests/tls/certificates_dir.h"

namespace flatshard::tls {
namespace {

class KeyPairTest : public testing::CertificatesDir {
 protected:
  void SetUp() override {
    CertificatesDir::SetUp();
    Use("client.pem", "cert.pem");
    Use("client.key", "key.pem");
  }
  absl::StatusOr<std::unique_ptr<KeyPair>> Start() const {
    return KeyPair::Start(File("cert.pem"), "tls_cert_file", File("key.pem"), "tls_key_file");
  }

};

TEST_F(KeyPairTest, ARenewedPairIsTakenOnceBothFilesAreWritten) {
  auto pair = Start();
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_EQ((*pair)->current().cert_chain, Read("client.pem"));
  EXPECT_EQ(ReadFileToString((*pair)->watched_path()).value_or(""), Read("client.key") + "\n" + Read("client.pem"))
      << "the key, then the chain";
  EXPECT_EQ((*pair)->Reload().value_or(true), false) << "nothing changed";

  Use("client2.pem", "cert.pem");  // the key is still to come
  const absl::StatusOr<bool> half = (*pair)->Reload();
  EXPECT_TRUE(absl::StrContains(half.status().message(), "is not the private key of the certificate in tls_cert_file="))
      << half.status();
  EXPECT_EQ((*pair)->current().cert_chain, Read("client.pem"));

  Use("client2.key", "key.pem");
  auto refuse = [](const KeyPair::Pem&) { return absl::FailedPreconditionError("not this one"); };
  EXPECT_EQ((*pair)->Reload(refuse).status().message(), "not this one");
  EXPECT_EQ((*pair)->current().cert_chain, Read("client.pem")) << "refused by its owner";
  EXPECT_EQ((*pair)->Reload().value_or(false), true);
  EXPECT_EQ((*pair)->current().cert_chain, Read("client2.pem"));
  EXPECT_GT((*pair)->current().expiry, absl::Now() + absl::Hours(60)) << "client2 is valid for three days";
  EXPECT_EQ(ReadFileToString((*pair)->watched_path()).value_or(""), Read("client2.key") + "\n" + Read("client2.pem"));

  Use("expired.pem", "cert.pem");
  Use("expired.key", "key.pem");
  const absl::StatusOr<bool> expired = (*pair)->Reload();
  EXPECT_TRUE(absl::StrContains(expired.status().message(), "a certificate of the chain expired")) << expired.status();
  std::filesystem::remove(File("key.pem"));
  const absl::StatusOr<bool> gone = (*pair)->Reload();
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "cannot read tls_key_file=")) << gone.status();
  EXPECT_EQ((*pair)->current().cert_chain, Read("client2.pem")) << "the last good pair stays";

  EXPECT_TRUE(absl::IsInvalidArgument(Start().status()));
  Use("server.key", "key.pem");
  EXPECT_TRUE(absl::IsInvalidArgument(Start().status())) << "expired.pem with server.key";
}

}  // namespace
}  // namespace flatshard::tls
