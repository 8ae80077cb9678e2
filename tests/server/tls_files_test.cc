// TlsFiles (server/tls_files.h): a renewed pair becomes the current one and the watched
// file's content, modified later; a pair that does not go together and a file that
// cannot be read leave the last good pair, and the log says why once. A new CA bundle is
// taken apart from the pair, and the peer calls' credentials (PeerCredentials) check
// against it. With client CAs, the control plane takes callers those CAs signed, peer
// calls present the server's certificate, and a pair and a client bundle that would not
// verify each other are not taken.
#include "server/tls_files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/file.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/scratch_dir.h"
#include "tests/test_certificates.h"
#include "tests/tls/tls_handshake.h"

namespace flatshard::server {
namespace {

std::string ReadFile(const std::string& path) { return ReadFileToString(path).value_or(""); }

time_t Modified(const std::string& path) {
  struct stat info {};
  EXPECT_EQ(stat(path.c_str(), &info), 0) << path;
  return info.st_mtime;
}

// What spdlog's default logger writes while it lives.
class CapturedLog {
 public:
  CapturedLog() : previous_(spdlog::default_logger()) {
    spdlog::set_default_logger(
        std::make_shared<spdlog::logger>("captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(text_)));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  // What was written since the last call.
  std::string Take() {
    std::string taken = text_.str();
    text_.str("");
    return taken;
  }

 private:
  std::ostringstream text_;
  std::shared_ptr<spdlog::logger> previous_;
};

// TLS options read from `cert_file`, `key_file` and `ca_file` (empty: none), as the server's
// flags give them, reloaded every `interval`.
TlsOptions ReadOptions(const std::string& cert_file, const std::string& key_file, const std::string& ca_file,
                       absl::Duration interval) {
  return {.cert_chain = ReadFile(cert_file),
          .private_key = ReadFile(key_file),
          .root_certs = ca_file.empty() ? "" : ReadFile(ca_file),
          .cert_file = cert_file,
          .key_file = key_file,
          .ca_file = ca_file,
          .reload_interval = interval};
}

TEST(TlsFilesTest, ARenewedPairIsTakenAndOneThatDoesNotGoTogetherIsNot) {
  CapturedLog log;
  const testing::ScratchDir dir("tls-files");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  std::filesystem::copy_file(file("server.pem"), file("cert.pem"));
  std::filesystem::copy_file(file("server.key"), file("key.pem"));
  const TlsOptions tls = ReadOptions(file("cert.pem"), file("key.pem"), "", absl::Hours(1));  // reloaded by hand
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  const std::string watched = (*files)->pair().watched_path();
  EXPECT_EQ(ReadFile(watched), tls.private_key + "\n" + tls.cert_chain);
  EXPECT_EQ((*files)->generation(), 0u);
  const absl::Time first_expiry = (*files)->expiry();  // two days from now
  EXPECT_GT(first_expiry, absl::Now() + absl::Hours(47));
  EXPECT_FALSE((*files)->Reload()) << "nothing changed";
  const time_t first = Modified(watched);

  EXPECT_EQ(log.Take(), "");
  std::filesystem::copy_file(file("server2.pem"), file("cert.pem"), std::filesystem::copy_options::overwrite_existing);
  EXPECT_FALSE((*files)->Reload()) << "the certificate renewed before its key";
  EXPECT_EQ((*files)->current().cert_chain, tls.cert_chain);
  EXPECT_EQ(ReadFile(watched), tls.private_key + "\n" + tls.cert_chain);
  EXPECT_TRUE(absl::StrContains(log.Take(), "not the private key")) << "told why";
  EXPECT_FALSE((*files)->Reload());
  EXPECT_EQ(log.Take(), "") << "told once, not every interval";

  std::filesystem::copy_file(file("server2.key"), file("key.pem"), std::filesystem::copy_options::overwrite_existing);
  EXPECT_TRUE((*files)->Reload());
  EXPECT_EQ((*files)->generation(), 1u);
  EXPECT_EQ((*files)->current().cert_chain, ReadFile(file("server2.pem")));
  EXPECT_EQ(ReadFile(watched), ReadFile(file("server2.key")) + "\n" + ReadFile(file("server2.pem")));
  EXPECT_GT(Modified(watched), first) << "a watcher could not tell the files apart";
  EXPECT_TRUE(absl::StrContains(log.Take(), "presenting the renewed certificate"));
  EXPECT_GT((*files)->expiry(), first_expiry + absl::Hours(23)) << "server2.pem is valid for a day longer";

  // A renewal to a certificate that has expired is no renewal.
  for (const char* name : {"expired.pem", "expired.key"}) {
    std::filesystem::copy_file(file(name), file(absl::EndsWith(name, ".pem") ? "cert.pem" : "key.pem"),
                               std::filesystem::copy_options::overwrite_existing);
  }
  EXPECT_FALSE((*files)->Reload());
  EXPECT_EQ((*files)->current().cert_chain, ReadFile(file("server2.pem")));
  EXPECT_TRUE(absl::StrContains(log.Take(), "expired")) << "told why";

  std::filesystem::remove(file("key.pem"));
  EXPECT_FALSE((*files)->Reload()) << "a key file that is gone";
  EXPECT_EQ((*files)->generation(), 1u);
  EXPECT_TRUE(absl::StrContains(log.Take(), "cannot read"));
}

TEST(TlsFilesTest, ANewCaBundleIsTakenApartFromThePairAndPeerCallsCheckAgainstIt) {
  const testing::ScratchDir dir("tls-files-ca");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  std::filesystem::copy_file(file("server.pem"), file("cert.pem"));
  std::filesystem::copy_file(file("ca.pem"), file("bundle.pem"));
  const TlsOptions tls = ReadOptions(file("cert.pem"), file("server.key"), file("bundle.pem"), absl::Seconds(1));
  ASSERT_TRUE(ValidateTls(tls).ok()) << ValidateTls(tls);
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_NE((*files)->ca_bundle(), nullptr);
  EXPECT_EQ((*files)->current().root_certs, tls.root_certs);
  const auto credentials = PeerCredentials(tls, files->get());
  const testing::TlsServer signed_by_other(ReadFile(file("other-server.pem")), ReadFile(file("other-server.key")));
  ASSERT_TRUE(signed_by_other.server);
  EXPECT_FALSE(testing::Handshakes(credentials, signed_by_other.port));

  // The certificate renewed before its key (a pair that does not go together) and a new
  // bundle: the bundle is taken, the pair is not.
  const uint64_t generation = (*files)->generation();
  std::filesystem::copy_file(file("server2.pem"), file("cert.pem"), std::filesystem::copy_options::overwrite_existing);
  const std::string both = ReadFile(file("ca.pem")) + ReadFile(file("other-ca.pem"));
  std::ofstream(file("bundle.pem"), std::ios::trunc) << both;
  (*files)->Reload();  // or the thread did, a second at most before
  EXPECT_EQ((*files)->generation(), generation + 1);
  EXPECT_EQ((*files)->current().root_certs, both);
  EXPECT_EQ((*files)->current().cert_chain, tls.cert_chain);
  EXPECT_EQ(ReadFile((*files)->pair().watched_path()), tls.private_key + "\n" + tls.cert_chain);
  EXPECT_TRUE(testing::ComesToHandshake(credentials, signed_by_other.port, true)) << "the peer calls' bundle";
}

TEST(TlsFilesTest, WithClientCasPeersPresentTheServersCertificateWhichTheClientBundleMustSign) {
  CapturedLog log;
  const testing::ScratchDir dir("tls-files-clients");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  auto use = [&](const std::string& from, const std::string& to) {
    std::filesystem::copy_file(file(from), file(to), std::filesystem::copy_options::overwrite_existing);
  };
  use("server.pem", "cert.pem");
  use("server.key", "key.pem");
  use("ca.pem", "clients.pem");
  TlsOptions tls = ReadOptions(file("cert.pem"), file("key.pem"), file("ca.pem"), absl::Seconds(1));
  tls.client_ca_file = file("clients.pem");
  tls.client_root_certs = ReadFile(file("clients.pem"));
  ASSERT_TRUE(ValidateTls(tls).ok()) << ValidateTls(tls);
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  testing::TlsServer control(ServerCredentials(tls, files->get()));
  ASSERT_TRUE(control.server);
  auto presenting = [&](const std::string& name) {  // none for ""
    return name.empty() ? testing::ClientCredentials(ReadFile(file("ca.pem")))
                        : testing::ClientCredentials(ReadFile(file("ca.pem")), ReadFile(file(name + ".pem")),
                                                     ReadFile(file(name + ".key")));
  };
  EXPECT_EQ(testing::PresentedName(presenting("client"), control), "client");
  EXPECT_EQ(testing::PresentedName(presenting(""), control), "(refused)") << "no client certificate";
  EXPECT_EQ(testing::PresentedName(PeerCredentials(tls, files->get()), control), "server") << "a peer's call";

  // A renewal that may not prove a client, and a client bundle that does not sign the
  // pair in use: neither is taken (the peers would refuse this server's calls).
  use("server-only.pem", "cert.pem");
  use("server-only.key", "key.pem");
  std::ofstream(file("clients.pem"), std::ios::trunc) << ReadFile(file("other-ca.pem"));
  (*files)->Reload();  // or the thread did, a second at most before
  EXPECT_EQ((*files)->current().cert_chain, tls.cert_chain);
  EXPECT_EQ((*files)->current().client_root_certs, tls.client_root_certs);
  const std::string told = log.Take();
  EXPECT_TRUE(absl::StrContains(told, "unsuitable certificate purpose")) << told;
  EXPECT_TRUE(absl::StrContains(told, "unable to get local issuer certificate")) << told;
  EXPECT_EQ((*files)->generation(), 0u);

  // A CA added to the client bundle: callers it signed are taken without a restart.
  use("server.pem", "cert.pem");
  use("server.key", "key.pem");
  std::ofstream(file("clients.pem"), std::ios::trunc) << ReadFile(file("ca.pem")) + ReadFile(file("other-ca.pem"));
  (*files)->Reload();
  EXPECT_EQ((*files)->generation(), 1u);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (testing::PresentedName(presenting("other-client"), control) != "other-client" && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(testing::PresentedName(presenting("other-client"), control), "other-client");
  EXPECT_TRUE(absl::StrContains(log.Take(), "callers' certificates are checked against the new CA bundle"));
}

TEST(TlsFilesTest, WithoutACaFileThePeersAreCheckedAgainstTheSystemsRoots) {
  const testing::ScratchDir dir("tls-files-no-ca");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  const TlsOptions tls = ReadOptions(file("server.pem"), file("server.key"), "", absl::Hours(1));
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ((*files)->ca_bundle(), nullptr);
  const testing::TlsServer signed_by_ca(ReadFile(file("server.pem")), ReadFile(file("server.key")));
  EXPECT_FALSE(testing::Handshakes(PeerCredentials(tls, files->get()), signed_by_ca.port)) << "a test CA trusted";
}

}  // namespace
}  // namespace flatshard::server
