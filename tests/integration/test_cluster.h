// TestCluster: starts N flatshard-server processes on 127.0.0.1 with free ports and a
// token, waits until they answer, and kills them (SIGTERM, then SIGKILL) on
// destruction. For integration tests only.
#ifndef FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_
#define FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "flatshard/client.h"
#include "transport/tcp/tcp_transport.h"

extern char** environ;

namespace flatshard::testing {

// Starts flatshard-server with `args` (argv[0] excluded); returns its pid, or -1.
inline pid_t SpawnServer(std::vector<std::string> args) {
  args.insert(args.begin(), FLATSHARD_SERVER_PATH);
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

// SIGTERM, then SIGKILL after 5 s; reaps the process.
inline void StopServer(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  int status = 0;
  for (int i = 0; i < 50 && waitpid(pid, &status, WNOHANG) == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  if (waitpid(pid, &status, WNOHANG) == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
}

class TestCluster {
 public:
  // `checkpoint_root` empty: checkpoints disabled on these servers. `extra_args[i]`
  // (when present) go to server i, e.g. {"--memory=device"}.
  TestCluster(int servers, std::string token, const std::string& scratch_dir,
              const std::string& checkpoint_root = "",
              const std::vector<std::vector<std::string>>& extra_args = {})
      : token_(std::move(token)) {
    // One file per process: ctest runs several clusters at once in the same TempDir().
    const std::string token_file = absl::StrCat(scratch_dir, "/token-", getpid());
    std::ofstream(token_file) << token_ << "\n";
    const std::vector<int> ports = *transport::PickFreeLoopbackPorts(2 * servers);
    std::vector<int> data_ports;
    for (int i = 0; i < servers; ++i) {
      addresses_.push_back(absl::StrCat("127.0.0.1:", ports[2 * i]));
      data_ports.push_back(ports[2 * i + 1]);
    }
    for (int i = 0; i < servers; ++i) {
      std::vector<std::string> args = {"--listen=" + addresses_[i],
                                       absl::StrCat("--data_listen=127.0.0.1:", data_ports[i]),
                                       absl::StrCat("--rank=", i),
                                       "--cluster=" + absl::StrJoin(addresses_, ","),
                                       "--auth_token_file=" + token_file};
      if (!checkpoint_root.empty()) args.push_back("--checkpoint_root=" + checkpoint_root);
      if (static_cast<size_t>(i) < extra_args.size()) {
        args.insert(args.end(), extra_args[i].begin(), extra_args[i].end());
      }
      pids_.push_back(SpawnServer(args));
    }
  }

  ~TestCluster() {
    for (pid_t pid : pids_) kill(pid, SIGTERM);
    for (pid_t pid : pids_) StopServer(pid);
  }

  // Connects a client as `worker_rank` of `num_workers`, retrying while servers start.
  absl::StatusOr<std::unique_ptr<Client>> Connect(int worker_rank, int num_workers,
                                                  const std::string& job = "test") const {
    ClientOptions options{.servers = addresses_,
                          .token = token_,
                          .worker_rank = worker_rank,
                          .num_workers = num_workers,
                          .job = job,
                          .timeout = absl::Seconds(20)};
    absl::StatusOr<std::unique_ptr<Client>> client;
    for (int attempt = 0; attempt < 100; ++attempt) {
      client = Client::Connect(options);
      if (client.ok() || !absl::IsUnavailable(client.status())) return client;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return client;
  }

  const std::vector<std::string>& addresses() const { return addresses_; }
  const std::string& token() const { return token_; }
  pid_t pid(int rank) const { return pids_[rank]; }

 private:
  std::string token_;
  std::vector<std::string> addresses_;
  std::vector<pid_t> pids_;
};

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_
