// The binaries' command lines as an operator meets them: --help lists every flag of the
// program (with where it is defined) and exits 0; a bad flag, a bad value or a missing
// value prints one line naming it and exits 2; a configuration the server cannot run
// (--listen not in --cluster, a control address in use) exits non-zero with the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cluster_status.h"
#include "tests/integration/test_cluster.h"
#include "tests/run_command.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Runs `binary args` with stderr folded into stdout: (exit code, output).
std::pair<int, std::string> RunBinary(const std::string& binary, const std::string& args) {
  return testing::RunCommand(binary + " " + args + " 2>&1 < /dev/null");
}

TEST(CommandLineTest, ServerHelpListsEveryFlag) {
  for (const char* help : {"--help", "--helpfull", "-h"}) {
    const auto [code, output] = RunBinary(FLATSHARD_SERVER_PATH, help);
    EXPECT_EQ(code, 0) << output;
    EXPECT_THAT(output, HasSubstr("Flags from server/main.cc"));
    for (const char* flag : {"--listen", "--data_listen", "--rank", "--cluster", "--memory", "--auth_token_file",
                             "--checkpoint_root", "--tls_cert_file", "--compute_threads", "--nccl_timeout"}) {
      EXPECT_THAT(output, HasSubstr(std::string(flag) + " (")) << help;
    }
    EXPECT_THAT(output, Not(HasSubstr("No flags matched")));
  }
}

TEST(CommandLineTest, CliHelpListsCommandsAndFlags) {
  const auto [code, output] = RunBinary(FLATSHARD_CLI_PATH, "--help");
  EXPECT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("local-cluster --servers=N"));
  EXPECT_THAT(output, HasSubstr("delete-job --cluster=... --job=J"));
  EXPECT_THAT(output, HasSubstr("Flags from client/cli/main.cc"));
  for (const char* flag : {"--cluster", "--name", "--kind", "--chunk_mib", "--tls_ca_file", "--cut", "--job",
                           "--workers", "--grad_dtype", "--gather_dtype"}) {
    EXPECT_THAT(output, HasSubstr(std::string(flag) + " ("));
  }
}

TEST(CommandLineTest, BadFlagsExitTwoWithOneLineNamingThem) {
  const struct {
    std::string args, message;
  } cases[] = {
      {"--bogus=1", "flatshard-server: unknown flag --bogus (see --help)\n"},
      {"--rank=x", "flatshard-server: bad value for --rank: "},
      {"--listen", "flatshard-server: flag --listen needs a value\n"},
      {"stray", "unexpected argument 'stray'"},
  };
  for (const auto& c : cases) {
    const auto [code, output] = RunBinary(FLATSHARD_SERVER_PATH, c.args);
    EXPECT_EQ(code, 2) << c.args << ": " << output;
    EXPECT_THAT(output, HasSubstr(c.message)) << c.args;
    EXPECT_EQ(std::vector<std::string>(absl::StrSplit(output, '\n', absl::SkipEmpty())).size(), 1u)
        << c.args << ": " << output;
  }
  const auto [code, output] = RunBinary(FLATSHARD_CLI_PATH, "status --bogus");
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("unknown flag --bogus"));
}

TEST(CommandLineTest, AServerNotInItsClusterRefusesToStart) {
  // Ports 1 and 2 are never bound: the check comes first.
  const auto [code, output] = RunBinary(FLATSHARD_SERVER_PATH, "--listen=127.0.0.1:1 --cluster=127.0.0.1:2 --rank=0");
  EXPECT_NE(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("--listen=127.0.0.1:1 but --cluster[0] is 127.0.0.1:2"));
}

// A second server on a control address in use exits instead of sharing the port with
// the first (gRPC's default SO_REUSEPORT would let it start and take half the calls).
TEST(CommandLineTest, AControlAddressInUseIsRefused) {
  testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  const std::string taken = cluster.addresses()[0];
  EXPECT_TRUE(testing::RefusesToStart({"--listen=" + taken, "--cluster=" + taken}));
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->ConfigureJob({}).ok());  // the first serves on
}

// Every address may be a host name (as the Kubernetes StatefulSet gives them: the pod's
// DNS name): the server binds what it resolves to, advertises the name, and a worker
// trains over it.
TEST(CommandLineTest, AddressesMayBeHostNames) {
  const std::vector<int> ports = *transport::PickFreeLoopbackPorts(2);
  const std::string control = absl::StrCat("localhost:", ports[0]);
  const pid_t pid =
      testing::SpawnServer({"--listen=" + control, "--cluster=" + control,
                            absl::StrCat("--data_listen=localhost:", ports[1]), "--metrics_listen=localhost:0"});
  ASSERT_GT(pid, 0);
  for (int i = 0; i < 200 && !testing::ListensOn(pid, ports[1]); ++i) absl::SleepFor(absl::Milliseconds(50));
  ClientOptions options{.servers = {control}, .timeout = absl::Seconds(30)};
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const auto status = FetchClusterStatus(options)[0];
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->data_address(), absl::StrCat("localhost:", ports[1]));
  EXPECT_THAT(status->metrics_address(), ::testing::StartsWith("localhost:"));
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {64}, DType::kFloat32}}, 0, SgdOptions{});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE((*client)->InitGroupFromSeed("g", 1).ok());
  std::vector<float> values(64);
  const auto bytes = absl::MakeSpan(reinterpret_cast<std::byte*>(values.data()), values.size() * 4);
  EXPECT_TRUE((*client)->Gather("g", 0, DType::kFloat32, bytes).get().ok());
  EXPECT_TRUE((*client)->Scatter("g", 0, DType::kFloat32, bytes).get().ok());
  EXPECT_TRUE((*client)->WaitVersion("g", 1).ok());
  client->reset();
  testing::StopServer(pid);
}

// A development cluster makes its checkpoint root, serves, and stops on SIGTERM.
TEST(CommandLineTest, LocalClusterMakesItsCheckpointRootAndStopsOnSigterm) {
  const std::string root = ::testing::TempDir() + "/local-cluster-root/not/yet/there";
  std::filesystem::remove_all(::testing::TempDir() + "/local-cluster-root");
  // The server's data port is --base_port + 1, which another test may take between the
  // pick and the bind (the server then exits saying so): start again on another port.
  int code = 0;
  std::string output;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int port = transport::PickFreeLoopbackPorts(1).value().front();
    const std::string cluster = absl::StrCat("127.0.0.1:", port);
    const std::string script = absl::StrCat(
        FLATSHARD_CLI_PATH, " local-cluster --servers=1 --base_port=", port, " --checkpoint_root=", root,
        " & pid=$!; up=no; for i in $(seq 100); do if ", FLATSHARD_CLI_PATH, " status --cluster=", cluster,
        " > /dev/null 2>&1; then up=yes; break; fi; sleep 0.1; done; echo up=$up; kill -TERM $pid; wait $pid; "
        "echo exit=$?");
    std::tie(code, output) = testing::RunCommand("timeout 60 sh -c '" + script + "' 2>&1 < /dev/null");
    if (output.find("Address already in use") == std::string::npos) break;
  }
  EXPECT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("up=yes"));
  EXPECT_THAT(output, HasSubstr("exit=0"));
  EXPECT_TRUE(std::filesystem::is_directory(root)) << output;

  const std::string file = ::testing::TempDir() + "/local-cluster-root/a-file";
  { std::ofstream(file) << "x"; }
  const auto [refused, message] =
      RunBinary(FLATSHARD_CLI_PATH, "local-cluster --servers=1 --checkpoint_root=" + file + "/root");
  EXPECT_EQ(refused, 1) << message;
  EXPECT_THAT(message, HasSubstr("cannot make --checkpoint_root=" + file + "/root"));
  std::filesystem::remove_all(::testing::TempDir() + "/local-cluster-root");
}

}  // namespace
}  // namespace flatshard
