// tls/certificates.h: CheckCertificates takes whole bundles only (also refusing one cut
// in a BEGIN line), CheckKeyPair a certificate's own key only, CertificateChainExpiry
// matches `openssl x509 -enddate`: a chain expires with its first certificate to,
// CheckIdentity refuses an expired certificate, CheckClientUse the key usage and
// CheckClientCertificate the signer too.
#include "tls/certificates.h"

#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/run_command.h"
#include "tests/tls/certificates_dir.h"

namespace flatshard::tls {
namespace {

class CertificatesTest : public testing::CertificatesDir {};

TEST_F(CertificatesTest, OnlyWholeCertificatesPass) {
  const std::string both = Read("ca.pem") + Read("other-ca.pem");
  EXPECT_TRUE(CheckCertificates(both, "bundle").ok());
  EXPECT_TRUE(CheckCertificates(Read("server.key") + Read("server.pem"), "key then chain").ok())
      << "other PEM blocks are passed over";
  // Cut in the second certificate's body, in its BEGIN line (a text whose whole
  // certificates all parse, one short), in the first one.
  const size_t second = Read("ca.pem").size();
  for (size_t cut : {both.size() - 30, second + 40, second + 1, second + 15, second + 26, size_t{40}}) {
    const absl::Status status = CheckCertificates(both.substr(0, cut), "bundle");
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << cut;
    EXPECT_TRUE(absl::StartsWith(status.message(), "bundle")) << status;
  }
  EXPECT_EQ(CheckCertificates(Read("server.csr"), "the CA file").message(), "the CA file holds no PEM certificate");
}

TEST_F(CertificatesTest, AKeyGoesWithItsCertificateOnly) {
  EXPECT_TRUE(CheckKeyPair(Read("server.pem") + Read("ca.pem"), "chain", Read("server.key"), "key").ok());
  EXPECT_EQ(CheckKeyPair(Read("server.pem"), "chain", Read("server2.key"), "key").message(),
            "key is not the private key of the certificate in chain");
  EXPECT_EQ(CheckKeyPair(Read("server.pem"), "chain", Read("server.pem"), "key").message(),
            "key holds no unencrypted PEM private key");
}

TEST_F(CertificatesTest, AChainExpiresWithItsEarliestNotAfter) {
  auto not_after = [&](const std::string& name) {
    const auto [code, out] = testing::RunCommand(absl::StrCat("openssl x509 -noout -enddate -in '", File(name), "'"));
    const std::string line(absl::StripTrailingAsciiWhitespace(out));
    absl::Time time = absl::InfinitePast();
    std::string error;
    EXPECT_TRUE(code == 0 &&
                absl::ParseTime("notAfter=%b %e %H:%M:%S %Y GMT", line, absl::UTCTimeZone(), &time, &error))
        << out << error;
    return time;
  };
  const absl::Time one_day = not_after("elsewhere.pem"), two_days = not_after("server.pem");
  ASSERT_LT(one_day, two_days);
  EXPECT_EQ(CertificateChainExpiry(Read("server.pem")).value_or(absl::InfinitePast()), two_days);
  EXPECT_EQ(CertificateChainExpiry(Read("server.pem") + Read("elsewhere.pem")).value_or(absl::InfinitePast()),
            one_day)
      << "an intermediate that expires first";
  EXPECT_TRUE(absl::IsInvalidArgument(CertificateChainExpiry("no certificate").status()));
}

TEST_F(CertificatesTest, AnIdentityIsAKeyAndItsUnexpiredCertificate) {
  const absl::StatusOr<absl::Time> expiry = CheckIdentity(Read("server.pem"), "cert", Read("server.key"), "key");
  ASSERT_TRUE(expiry.ok()) << expiry.status();
  EXPECT_EQ(*expiry, CertificateChainExpiry(Read("server.pem")).value_or(absl::InfinitePast()));
  EXPECT_EQ(CheckIdentity(Read("server.pem"), "cert", Read("server2.key"), "key").status().message(),
            "key is not the private key of the certificate in cert");
  const absl::Status expired = CheckIdentity(Read("expired.pem"), "cert", Read("expired.key"), "key").status();
  EXPECT_TRUE(absl::StartsWith(expired.message(), "cert: a certificate of the chain expired ")) << expired;
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckIdentity(Read("server.pem").substr(0, 100), "cert", Read("server.key"), "key").status()));
}

TEST_F(CertificatesTest, OnlyACertificateForClientUseMayProveAClient) {
  for (const char* good : {"client.pem", "server.pem"}) {  // server.pem: no key usage named
    EXPECT_TRUE(CheckClientUse(Read(good), good).ok()) << good;
  }
  EXPECT_EQ(CheckClientUse(Read("server-only.pem"), "cert").message(),
            "cert: the certificate may not prove a TLS client (its extendedKeyUsage lacks clientAuth): servers that "
            "ask for client certificates refuse it");
}

TEST_F(CertificatesTest, AClientCertificateMustBeSignedByABundleCaForClientUse) {
  const std::string both = Read("ca.pem") + Read("other-ca.pem");
  for (const char* good : {"client.pem", "other-client.pem", "server.pem"}) {  // server.pem: no key usage named
    EXPECT_TRUE(CheckClientCertificate(Read(good), good, both, "bundle").ok()) << good;
  }
  const absl::Status unknown = CheckClientCertificate(Read("other-client.pem"), "cert", Read("ca.pem"), "bundle");
  EXPECT_TRUE(absl::StartsWith(unknown.message(), "cert: the certificate does not verify as a TLS client's against "
                                                  "bundle (unable to get local issuer certificate"))
      << unknown;
  const absl::Status server_only = CheckClientCertificate(Read("server-only.pem"), "cert", both, "bundle");
  EXPECT_TRUE(absl::StrContains(server_only.message(), "(unsuitable certificate purpose)")) << server_only;
  EXPECT_TRUE(absl::IsInvalidArgument(CheckClientCertificate(Read("expired.pem"), "cert", both, "bundle")));
}

}  // namespace
}  // namespace flatshard::tls
