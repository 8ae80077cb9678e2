// TestCluster: starts N flatshard-server processes on 127.0.0.1 with free ports and a
// token, waits until they answer, and kills them (SIGTERM, then SIGKILL) on
// destruction. For integration tests only.
#ifndef FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_
#define FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_

#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "flatshard/client.h"

extern char** environ;

namespace flatshard::testing {

// `count` distinct ports that were free a moment ago: all are bound to port 0 at once
// (so the kernel cannot hand out one twice), then released for the servers to bind.
inline std::vector<int> FreePorts(int count) {
  std::vector<int> fds, ports;
  for (int i = 0; i < count; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    fds.push_back(fd);
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) close(fd);
  return ports;
}

class TestCluster {
 public:
  TestCluster(int servers, std::string token, const std::string& scratch_dir)
      : token_(std::move(token)) {
    // One file per process: ctest runs several clusters at once in the same TempDir().
    const std::string token_file = absl::StrCat(scratch_dir, "/token-", getpid());
    std::ofstream(token_file) << token_ << "\n";
    const std::vector<int> ports = FreePorts(2 * servers);
    std::vector<int> data_ports;
    for (int i = 0; i < servers; ++i) {
      addresses_.push_back(absl::StrCat("127.0.0.1:", ports[2 * i]));
      data_ports.push_back(ports[2 * i + 1]);
    }
    for (int i = 0; i < servers; ++i) {
      std::vector<std::string> args = {FLATSHARD_SERVER_PATH,
                                       "--listen=" + addresses_[i],
                                       absl::StrCat("--data_listen=127.0.0.1:", data_ports[i]),
                                       absl::StrCat("--rank=", i),
                                       "--cluster=" + absl::StrJoin(addresses_, ","),
                                       "--auth_token_file=" + token_file};
      std::vector<char*> argv;
      for (std::string& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      pid_t pid = 0;
      if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0) pids_.push_back(pid);
    }
  }

  ~TestCluster() {
    for (pid_t pid : pids_) kill(pid, SIGTERM);
    for (pid_t pid : pids_) {
      int status = 0;
      for (int i = 0; i < 50 && waitpid(pid, &status, WNOHANG) == 0; ++i) absl::SleepFor(absl::Milliseconds(100));
      if (kill(pid, 0) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
      }
    }
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
