#include "client/cli/local_cluster_command.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace flatshard::cli {
namespace {

void StopAll(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  for (pid_t pid : pids) {
    if (pid > 0) waitpid(pid, nullptr, 0);
  }
}

}  // namespace

int RunLocalClusterCommand(const LocalClusterOptions& options) {
  if (options.servers < 1 || options.servers > 64) {
    std::cerr << "flatshard local-cluster: --servers must be in [1, 64]\n";
    return 2;
  }
  if (options.base_port < 1024 || options.base_port + 2 * options.servers > 65535) {
    std::cerr << "flatshard local-cluster: --base_port must leave room for " << 2 * options.servers
              << " ports in [1024, 65535]\n";
    return 2;
  }
  // Servers insist on an existing root (a typo or an unmounted volume must not become an
  // empty one); for a development cluster, making it is what one wants.
  if (!options.checkpoint_root.empty()) {
    std::error_code error;
    std::filesystem::create_directories(options.checkpoint_root, error);
    if (error) {
      std::cerr << "flatshard local-cluster: cannot make --checkpoint_root=" << options.checkpoint_root << ": "
                << error.message() << "\n";
      return 1;
    }
  }
  std::vector<std::string> addresses;
  for (int i = 0; i < options.servers; ++i) {
    addresses.push_back(absl::StrCat("127.0.0.1:", options.base_port + 2 * i));
  }
  const std::string cluster = absl::StrJoin(addresses, ",");

  // Stop signals are taken with sigwait; children get the default disposition back.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGCHLD);
  sigset_t previous;
  pthread_sigmask(SIG_BLOCK, &signals, &previous);

  std::vector<pid_t> pids;
  for (int i = 0; i < options.servers; ++i) {
    std::vector<std::string> args = {options.server_binary, "--listen=" + addresses[i],
                                     absl::StrCat("--rank=", i), "--cluster=" + cluster};
    if (!options.auth_token_file.empty()) args.push_back("--auth_token_file=" + options.auth_token_file);
    if (!options.checkpoint_root.empty()) args.push_back("--checkpoint_root=" + options.checkpoint_root);
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigmask(&attr, &previous);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    pid_t pid = 0;
    const int err = posix_spawn(&pid, options.server_binary.c_str(), nullptr, &attr, argv.data(), environ);
    posix_spawnattr_destroy(&attr);
    if (err != 0) {
      std::cerr << "flatshard local-cluster: cannot start " << options.server_binary << ": "
                << strerror(err) << "\n";
      StopAll(pids);
      return 1;
    }
    pids.push_back(pid);
  }
  std::cout << "local cluster of " << options.servers << " servers: --cluster=" << cluster
            << "\nCtrl-C stops them." << std::endl;

  while (true) {
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    if (signal_number != SIGCHLD) {
      StopAll(pids);
      std::cout << "local cluster stopped" << std::endl;
      return 0;
    }
    for (pid_t& pid : pids) {
      int status = 0;
      if (pid > 0 && waitpid(pid, &status, WNOHANG) == pid) {
        std::cerr << "flatshard local-cluster: server pid " << pid << " exited ("
                  << (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status))
                  << "); stopping the others\n";
        pid = -1;
        StopAll(pids);
        return 1;
      }
    }
  }
}

}  // namespace flatshard::cli
