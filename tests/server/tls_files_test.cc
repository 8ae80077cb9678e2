// TlsFiles (server/tls_files.h): a renewed pair becomes the current one and the watched
// file's content, modified later; a pair that does not go together and a file that
// cannot be read leave the last good pair. A new CA bundle is taken apart from the pair
// unless it is cut short, and the peer calls' credentials (PeerCredentials) check a
// server's certificate against the bundle of the moment and its host name.
#include "server/tls_files.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/file.h"
#include "proto/flatshard.grpc.pb.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/run_command.h"
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

TEST(TlsFilesTest, ARenewedPairIsTakenAndOneThatDoesNotGoTogetherIsNot) {
  CapturedLog log;
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

  std::filesystem::remove(file("key.pem"));
  EXPECT_FALSE((*files)->Reload()) << "a key file that is gone";
  EXPECT_EQ((*files)->generation(), 1u);
  EXPECT_TRUE(absl::StrContains(log.Take(), "cannot read"));
}

TEST(TlsFilesTest, ANewCaBundleIsTakenApartFromThePairAndOneCutShortIsNot) {
  const testing::ScratchDir dir("tls-files-ca");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  std::filesystem::copy_file(file("server.pem"), file("cert.pem"));
  std::filesystem::copy_file(file("ca.pem"), file("bundle.pem"));
  const TlsOptions tls{.cert_chain = ReadFile(file("cert.pem")),
                       .private_key = ReadFile(file("server.key")),
                       .root_certs = ReadFile(file("bundle.pem")),
                       .cert_file = file("cert.pem"),
                       .key_file = file("server.key"),
                       .ca_file = file("bundle.pem"),
                       .reload_interval = absl::Hours(1)};
  ASSERT_TRUE(ValidateTls(tls).ok()) << ValidateTls(tls);
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  const std::string roots = (*files)->watched_roots_path();
  ASSERT_FALSE(roots.empty());
  EXPECT_NE(roots, (*files)->watched_path());
  EXPECT_EQ(ReadFile(roots), tls.root_certs);
  const time_t first = Modified(roots);

  // The certificate renewed before its key (a pair that does not go together) and a new
  // bundle: the bundle is taken, the pair is not.
  std::filesystem::copy_file(file("server2.pem"), file("cert.pem"), std::filesystem::copy_options::overwrite_existing);
  const std::string both = ReadFile(file("ca.pem")) + ReadFile(file("other-ca.pem"));
  std::ofstream(file("bundle.pem"), std::ios::trunc) << both;
  EXPECT_TRUE((*files)->Reload());
  EXPECT_EQ((*files)->generation(), 1u);
  EXPECT_EQ((*files)->current().root_certs, both);
  EXPECT_EQ((*files)->current().cert_chain, tls.cert_chain);
  EXPECT_EQ(ReadFile(roots), both);
  EXPECT_GT(Modified(roots), first);
  EXPECT_EQ(ReadFile((*files)->watched_path()), tls.private_key + "\n" + tls.cert_chain);

  // A bundle being written: its last certificate cut short. Then one with no certificate.
  const std::string other = ReadFile(file("other-ca.pem"));
  const std::string cut = ReadFile(file("ca.pem")) + other.substr(0, other.size() / 2);
  for (const std::string& bad : {cut, std::string("not a certificate\n")}) {
    std::ofstream(file("bundle.pem"), std::ios::trunc) << bad;
    EXPECT_FALSE((*files)->Reload()) << bad;
    EXPECT_EQ(ReadFile(roots), both);
    TlsOptions checked = tls;
    checked.root_certs = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(ValidateTls(checked))) << bad;
  }
  EXPECT_EQ((*files)->generation(), 1u);
}

// A TLS gRPC server on 127.0.0.1 presenting `cert` with `key`, on a port of its own
// (every call answered Unimplemented).
struct TlsServer {
  TlsServer(const std::string& cert, const std::string& key) {
    grpc::SslServerCredentialsOptions options;
    options.pem_key_cert_pairs.push_back({key, cert});
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(options), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~TlsServer() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  int port = 0;
  v1::Flatshard::Service service;
  std::unique_ptr<grpc::Server> server;
};

// Whether a new channel with `credentials` completes its handshake with 127.0.0.1:`port`
// (false once it fails, or after 20 s).
bool Handshakes(const std::shared_ptr<grpc::ChannelCredentials>& credentials, int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own, not one failed before
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), credentials, args);
  const auto deadline = absl::ToChronoTime(absl::Now() + absl::Seconds(20));
  for (grpc_connectivity_state state = channel->GetState(true);; state = channel->GetState(true)) {
    if (state == GRPC_CHANNEL_READY) return true;
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || !channel->WaitForStateChange(state, deadline)) return false;
  }
}

// CertificateChainExpiry (server/tls.h) against `openssl x509 -enddate`: a chain
// expires with its first certificate to.
TEST(CertificateChainExpiryTest, IsTheEarliestNotAfterOfTheChain) {
  const testing::ScratchDir dir("tls-expiry");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  auto not_after = [&](const std::string& name) {
    const auto [code, out] = testing::RunCommand(absl::StrCat("openssl x509 -noout -enddate -in '", file(name), "'"));
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
  EXPECT_EQ(CertificateChainExpiry(ReadFile(file("server.pem"))).value_or(absl::InfinitePast()), two_days);
  EXPECT_EQ(CertificateChainExpiry(ReadFile(file("server.pem")) + ReadFile(file("elsewhere.pem")))
                .value_or(absl::InfinitePast()),
            one_day)
      << "an intermediate that expires first";
  EXPECT_TRUE(absl::IsInvalidArgument(CertificateChainExpiry("no certificate").status()));
}

TEST(TlsFilesTest, PeerCallsCheckTheCaBundleOfTheMomentAndTheHostName) {
  const testing::ScratchDir dir("tls-files-peers");
  ASSERT_TRUE(testing::MakeTestCertificates(dir.path()));
  auto file = [&](const std::string& name) { return absl::StrCat(dir.path(), "/", name); };
  std::filesystem::copy_file(file("ca.pem"), file("bundle.pem"));
  const TlsOptions tls{.cert_chain = ReadFile(file("server.pem")),
                       .private_key = ReadFile(file("server.key")),
                       .root_certs = ReadFile(file("bundle.pem")),
                       .cert_file = file("server.pem"),
                       .key_file = file("server.key"),
                       .ca_file = file("bundle.pem"),
                       .reload_interval = absl::Seconds(1)};
  auto files = TlsFiles::Start(tls);
  ASSERT_TRUE(files.ok()) << files.status();
  const auto credentials = PeerCredentials(tls, files->get());
  const TlsServer signed_by_ca(ReadFile(file("server.pem")), ReadFile(file("server.key")));
  const TlsServer signed_by_other(ReadFile(file("other-server.pem")), ReadFile(file("other-server.key")));
  const TlsServer another_host(ReadFile(file("elsewhere.pem")), ReadFile(file("elsewhere.key")));
  ASSERT_TRUE(signed_by_ca.server && signed_by_other.server && another_host.server);

  EXPECT_TRUE(Handshakes(credentials, signed_by_ca.port));
  EXPECT_FALSE(Handshakes(credentials, signed_by_other.port)) << "a CA not in the bundle";
  EXPECT_FALSE(Handshakes(credentials, another_host.port)) << "a certificate for another host";

  // The other CA joins the bundle: the same credentials trust it once the files are
  // read again (every second here), without a restart.
  std::ofstream(file("bundle.pem"), std::ios::trunc) << ReadFile(file("ca.pem")) + ReadFile(file("other-ca.pem"));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  bool trusted = false;
  while (!(trusted = Handshakes(credentials, signed_by_other.port)) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(trusted) << "the new bundle was not taken";
  EXPECT_TRUE(Handshakes(credentials, signed_by_ca.port));
  EXPECT_FALSE(Handshakes(credentials, another_host.port));

  // Then the first CA leaves it.
  std::ofstream(file("bundle.pem"), std::ios::trunc) << ReadFile(file("other-ca.pem"));
  const absl::Time later = absl::Now() + absl::Seconds(20);
  bool refused = false;
  while (!(refused = !Handshakes(credentials, signed_by_ca.port)) && absl::Now() < later) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(refused) << "the old CA is still trusted";
  EXPECT_TRUE(Handshakes(credentials, signed_by_other.port));
}

}  // namespace
}  // namespace flatshard::server
