// tls::CaBundle (tls/ca_bundle.h): a new bundle is taken, one cut short, gone or refused
// by its owner's check is not; credentials watching it (tls/credentials.h) check a
// server's certificate against the bundle of the moment and its host name, through a
// CA's addition and removal (reloaded by a tls::Reloader).
#include "tls/ca_bundle.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "tests/tls/certificates_dir.h"
#include "tests/tls/tls_handshake.h"
#include "tls/credentials.h"
#include "tls/reloader.h"

namespace flatshard::tls {
namespace {

class CaBundleTest : public testing::CertificatesDir {
 protected:
  void SetUp() override {
    CertificatesDir::SetUp();
    Use("ca.pem", "bundle.pem");
  }
};

TEST_F(CaBundleTest, ANewBundleIsTakenAndOneCutShortOrGoneIsNot) {
  auto bundle = CaBundle::Start(File("bundle.pem"), "tls_ca_file");
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  EXPECT_EQ((*bundle)->current(), Read("ca.pem"));
  EXPECT_EQ((*bundle)->Reload().value_or(true), false) << "nothing changed";

  const std::string both = Read("ca.pem") + Read("other-ca.pem");
  Write("bundle.pem", both);
  auto refuse = [](const std::string&) { return absl::FailedPreconditionError("not this one"); };
  EXPECT_EQ((*bundle)->Reload(refuse).status().message(), "not this one");
  EXPECT_EQ((*bundle)->current(), Read("ca.pem")) << "refused by its owner";
  EXPECT_EQ((*bundle)->Reload().value_or(false), true);
  EXPECT_EQ((*bundle)->current(), both);

  const std::string other = Read("other-ca.pem");
  Write("bundle.pem", Read("ca.pem") + other.substr(0, other.size() / 2));  // being written
  absl::StatusOr<bool> cut = (*bundle)->Reload();
  EXPECT_TRUE(absl::IsInvalidArgument(cut.status())) << cut.status();
  EXPECT_TRUE(absl::StrContains(cut.status().message(), "certificate 2 of 2 does not parse")) << cut.status();
  std::filesystem::remove(File("bundle.pem"));
  absl::StatusOr<bool> gone = (*bundle)->Reload();
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "cannot read tls_ca_file=")) << gone.status();
  EXPECT_EQ((*bundle)->current(), both) << "the last good bundle stays";

  EXPECT_TRUE(absl::IsInvalidArgument(CaBundle::Start(File("bundle.pem"), "tls_ca_file").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(CaBundle::Start(File("server.csr"), "tls_ca_file").status())) << "no certificate";
}

TEST_F(CaBundleTest, CredentialsCheckTheBundleOfTheMomentAndTheHostName) {
  auto bundle = CaBundle::Start(File("bundle.pem"), "tls_ca_file");
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  const Reloader reloader(absl::Seconds(1), [&] { (void)(*bundle)->Reload(); });
  const auto credentials = WatchedChannelCredentials(bundle->get(), nullptr);
  const testing::TlsServer signed_by_ca(Read("server.pem"), Read("server.key"));
  const testing::TlsServer signed_by_other(Read("other-server.pem"), Read("other-server.key"));
  const testing::TlsServer another_host(Read("elsewhere.pem"), Read("elsewhere.key"));
  ASSERT_TRUE(signed_by_ca.server && signed_by_other.server && another_host.server);

  EXPECT_TRUE(testing::Handshakes(credentials, signed_by_ca.port));
  EXPECT_FALSE(testing::Handshakes(credentials, signed_by_other.port)) << "a CA not in the bundle";
  EXPECT_FALSE(testing::Handshakes(credentials, another_host.port)) << "a certificate for another host";

  // The other CA joins the bundle: the same credentials trust it once the file is read
  // again (every second here), without new credentials.
  Write("bundle.pem", Read("ca.pem") + Read("other-ca.pem"));
  EXPECT_TRUE(testing::ComesToHandshake(credentials, signed_by_other.port, true)) << "the new bundle was not taken";
  EXPECT_TRUE(testing::Handshakes(credentials, signed_by_ca.port));
  EXPECT_FALSE(testing::Handshakes(credentials, another_host.port));

  // A bundle cut short in the middle of its writing changes nothing.
  const std::string other = Read("other-ca.pem");
  Write("bundle.pem", other.substr(0, other.size() / 2));
  absl::SleepFor(absl::Seconds(3));  // three reloads
  EXPECT_TRUE(testing::Handshakes(credentials, signed_by_ca.port));

  // Then the first CA leaves it.
  Write("bundle.pem", other);
  EXPECT_TRUE(testing::ComesToHandshake(credentials, signed_by_ca.port, false)) << "the old CA is still trusted";
  EXPECT_TRUE(testing::Handshakes(credentials, signed_by_other.port));
}

}  // namespace
}  // namespace flatshard::tls
