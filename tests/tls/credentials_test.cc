// tls/credentials.h with client certificates (mutual TLS): channel credentials present
// the key pair's certificate to a server that asks for one, and its renewal once the
// files are read again; server credentials ask every client for a certificate the
// client bundle of the moment signed.
#include "tls/credentials.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "tests/tls/certificates_dir.h"
#include "tests/tls/tls_handshake.h"
#include "tls/reloader.h"

namespace flatshard::tls {
namespace {

class CredentialsTest : public testing::CertificatesDir {
 protected:
  // Credentials trusting ca.pem and presenting `name`.pem (none for "").
  std::shared_ptr<grpc::ChannelCredentials> Presenting(const std::string& name) const {
    return name.empty() ? testing::ClientCredentials(Read("ca.pem"))
                        : testing::ClientCredentials(Read("ca.pem"), Read(name + ".pem"), Read(name + ".key"));
  }
};

TEST_F(CredentialsTest, AClientPresentsItsCertificateAndItsRenewal) {
  Use("client.pem", "cert.pem");
  Use("client.key", "key.pem");
  auto bundle = CaBundle::Start(File("ca.pem"), "tls_ca_file");
  auto pair = KeyPair::Start(File("cert.pem"), "tls_cert_file", File("key.pem"), "tls_key_file");
  ASSERT_TRUE(bundle.ok() && pair.ok()) << bundle.status() << pair.status();
  const Reloader reloader(absl::Seconds(1), [&] { (void)(*pair)->Reload(); });
  const auto credentials = WatchedChannelCredentials(bundle->get(), pair->get());

  testing::TlsServer asking(Read("server.pem"), Read("server.key"), Read("ca.pem"));
  testing::TlsServer not_asking(Read("server.pem"), Read("server.key"));
  testing::TlsServer asking_other_ca(Read("server.pem"), Read("server.key"), Read("other-ca.pem"));
  ASSERT_TRUE(asking.server && not_asking.server && asking_other_ca.server);
  EXPECT_EQ(testing::PresentedName(credentials, asking), "client");
  EXPECT_EQ(testing::PresentedName(credentials, not_asking), "(none)");
  EXPECT_EQ(testing::PresentedName(credentials, asking_other_ca), "(refused)");
  EXPECT_EQ(testing::PresentedName(WatchedChannelCredentials(bundle->get(), nullptr), asking),
            "(refused)")
      << "no certificate";

  Use("client2.pem", "cert.pem");
  Use("client2.key", "key.pem");
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (testing::PresentedName(credentials, asking) != "client2" && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(testing::PresentedName(credentials, asking), "client2") << "the renewal was not presented";
}

TEST_F(CredentialsTest, AServerTakesClientsTheBundleOfTheMomentSigned) {
  Use("ca.pem", "clients.pem");
  auto pair = KeyPair::Start(File("server.pem"), "--tls_cert_file", File("server.key"), "--tls_key_file");
  auto clients = CaBundle::Start(File("clients.pem"), "--tls_client_ca_file");
  ASSERT_TRUE(pair.ok() && clients.ok()) << pair.status() << clients.status();
  const Reloader reloader(absl::Seconds(1), [&] { (void)(*clients)->Reload(); });
  testing::TlsServer server(WatchedServerCredentials(**pair, clients->get()));
  ASSERT_TRUE(server.server);

  EXPECT_EQ(testing::PresentedName(Presenting("client"), server), "client");
  EXPECT_EQ(testing::PresentedName(Presenting("server"), server), "server") << "a server calling its peer";
  EXPECT_EQ(testing::PresentedName(Presenting(""), server), "(refused)") << "no certificate";
  EXPECT_EQ(testing::PresentedName(Presenting("other-client"), server), "(refused)") << "a CA not in the bundle";
  EXPECT_EQ(testing::PresentedName(Presenting("server-only"), server), "(refused)") << "not for client use";

  Write("clients.pem", Read("ca.pem") + Read("other-ca.pem"));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (testing::PresentedName(Presenting("other-client"), server) != "other-client" && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(testing::PresentedName(Presenting("other-client"), server), "other-client") << "the new bundle";
  EXPECT_EQ(testing::PresentedName(Presenting("client"), server), "client");
}

}  // namespace
}  // namespace flatshard::tls
