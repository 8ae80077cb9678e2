// TestCluster: starts N flatshard-server processes on 127.0.0.1 with free ports and a
// token, waits until they answer, and kills them (SIGTERM, then SIGKILL) on
// destruction. For integration tests only.
#ifndef FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_
#define FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "flatshard/client.h"
#include "proto/flatshard.grpc.pb.h"
#include "transport/data_protocol.h"
#include "transport/tcp/tcp_transport.h"

extern char** environ;

namespace flatshard::testing {

// Starts the program at `path` with `args` (argv[0] excluded); returns its pid, or -1.
inline pid_t SpawnProcess(const std::string& path, std::vector<std::string> args) {
  args.insert(args.begin(), path);
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

// Starts flatshard-server with `args`; returns its pid, or -1. Every lock the server takes
// is checked for lock-order cycles (--mutex_deadlock_detection, which `args` may turn off).
inline pid_t SpawnServer(std::vector<std::string> args) {
  args.insert(args.begin(), "--mutex_deadlock_detection");
  return SpawnProcess(FLATSHARD_SERVER_PATH, std::move(args));
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

// True when process `pid` itself listens on 127.0.0.1:`port`: a socket in LISTEN state
// on that port (/proc/net/tcp, tcp6) is one of its descriptors (/proc/<pid>/fd). A port
// picked free may have been taken by another process before the server bound it.
inline bool ListensOn(pid_t pid, int port) {
  std::vector<std::string> sockets;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the column names
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, skip, inode;
      fields >> slot >> local >> remote >> state;
      for (int i = 0; i < 5; ++i) fields >> skip;  // tx:rx, tr:when, retrnsmt, uid, timeout
      fields >> inode;
      const size_t colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) sockets.push_back("socket:[" + inode + "]");
    }
  }
  std::error_code error;  // the process may be gone, or close descriptors meanwhile
  for (std::filesystem::directory_iterator fd(absl::StrCat("/proc/", pid, "/fd"), error), end;
       !error && fd != end; fd.increment(error)) {
    const std::string target = std::filesystem::read_symlink(fd->path(), error).string();
    if (std::find(sockets.begin(), sockets.end(), target) != sockets.end()) return true;
    error.clear();
  }
  return false;
}

// Spawns a server on free ports (control and data: the default data port, control + 1,
// may be another test's) with `flags` and waits up to 5 s for it to exit: true when it
// exited with a non-zero status. A server still running is stopped.
inline bool RefusesToStart(const std::vector<std::string>& flags) {
  const std::vector<int> ports = *transport::PickFreeLoopbackPorts(2);
  const std::string address = absl::StrCat("127.0.0.1:", ports[0]);
  std::vector<std::string> args = {"--listen=" + address, "--cluster=" + address,
                                   absl::StrCat("--data_listen=127.0.0.1:", ports[1])};
  args.insert(args.end(), flags.begin(), flags.end());
  const pid_t pid = testing::SpawnServer(args);
  if (pid <= 0) return false;
  int status = 0;
  for (int i = 0; i < 100 && waitpid(pid, &status, WNOHANG) == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  if (waitpid(pid, &status, WNOHANG) == 0 && kill(pid, 0) == 0) {
    testing::StopServer(pid);
    return false;
  }
  return WIFEXITED(status) && WEXITSTATUS(status) != 0;
}

class TestCluster {
 public:
  // `checkpoint_root` empty: checkpoints disabled on these servers. `extra_args[i]`
  // (when present) go to server i, e.g. {"--memory=device"}, after the flags above (a
  // flag given again overrides); "{cluster}" in them stands for the servers' control
  // addresses, comma-separated. Returns once every server listens on its ports (or
  // after 30 s).
  TestCluster(int servers, std::string token, const std::string& scratch_dir,
              const std::string& checkpoint_root = "",
              const std::vector<std::vector<std::string>>& extra_args = {})
      : token_(std::move(token)) {
    // One file per cluster: ctest runs several clusters at once in the same TempDir().
    static std::atomic<int> clusters{0};
    token_file_ = absl::StrCat(scratch_dir, "/token-", getpid(), "-", clusters++);
    std::ofstream(token_file_) << token_ << "\n";
    for (int attempt = 1;; ++attempt) {
      Spawn(servers, checkpoint_root, extra_args);
      if (AwaitListening(absl::Seconds(30)) || attempt == 3) break;
      // A port picked free was taken (by another test's client or cluster) before its
      // server bound it, and the server exited: start the cluster again on other ports.
      std::cerr << "TestCluster: a server exited while starting; starting again on other ports\n";
      StopAll();
    }
  }

  // Kills server `rank` (SIGKILL: nothing saved, nothing said to peers or clients) and
  // starts it again with the same flags, or on data port `data_port` when given; it
  // comes back empty.
  void Restart(int rank, int data_port = 0) {
    if (pids_[rank] > 0) kill(pids_[rank], SIGKILL);
    StopServer(pids_[rank]);
    if (data_port > 0) {
      for (std::string& arg : args_[rank]) {
        if (absl::StartsWith(arg, "--data_listen=")) arg = absl::StrCat("--data_listen=127.0.0.1:", data_port);
      }
      ports_[rank].second = data_port;
    }
    pids_[rank] = SpawnServer(args_[rank]);
  }

  ~TestCluster() {
    StopAll();
    std::remove(token_file_.c_str());
  }

  // Connects a client as `worker_rank` of `num_workers`, retrying while servers start.
  absl::StatusOr<std::unique_ptr<Client>> Connect(int worker_rank, int num_workers,
                                                  const std::string& job = "test",
                                                  DevicePlane plane = DevicePlane::kAuto) const {
    return Connect({.worker_rank = worker_rank,
                    .num_workers = num_workers,
                    .job = job,
                    .timeout = absl::Seconds(20),
                    .device_plane = plane});
  }
  // The same with `options` (their servers and token filled in).
  absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options) const {
    options.servers = addresses_;
    options.token = token_;
    absl::StatusOr<std::unique_ptr<Client>> client;
    for (int attempt = 0; attempt < 100; ++attempt) {
      client = Client::Connect(options);
      if (client.ok() || !absl::IsUnavailable(client.status())) return client;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return client;
  }

  // A raw data-plane connection to server `rank`, its session opened over gRPC. With
  // `hello`, a kHello is sent with the session's token (or `token`, when given) and the
  // answer read; a refused session token is an error, a refused `token` is not.
  absl::StatusOr<std::unique_ptr<transport::Connection>> RawDataConnection(
      int rank, bool hello = true, const std::string& token = "") const {
    auto stub = v1::Flatshard::NewStub(
        grpc::CreateChannel(addresses_[rank], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token_);
    v1::OpenSessionResponse session;
    if (grpc::Status opened = stub->OpenSession(&ctx, v1::OpenSessionRequest(), &session); !opened.ok()) {
      return absl::UnavailableError(absl::StrCat("OpenSession: ", opened.error_message()));
    }
    std::string host;
    int port = 0;
    FLATSHARD_RETURN_IF_ERROR(transport::SplitHostPort(session.data_address(), host, port));
    FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<transport::Connection> conn,
                               transport::ConnectTcp(host, port, absl::Seconds(5)));
    FLATSHARD_RETURN_IF_ERROR(conn->SetTimeout(absl::Seconds(10)));
    if (!hello) return conn;
    const std::string presented = token.empty() ? session.session_token() : token;
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kHello);
    FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(
        *conn, header, "", "",
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(presented.data()), presented.size())));
    FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(*conn, {}));
    if (token.empty()) FLATSHARD_RETURN_IF_ERROR(response.status);
    return conn;
  }

  // Phase `phase` of load `load_id` of checkpoint `name` into `job`, sent by hand to
  // server `rank`: its answer.
  absl::Status LoadPhase(int rank, const std::string& job, const std::string& name, uint64_t load_id,
                         v1::LoadCheckpointRequest::Phase phase) const {
    v1::LoadCheckpointRequest request;
    request.set_name(name);
    request.set_job(job);
    request.set_load_id(load_id);
    request.set_phase(phase);
    auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(addresses_[rank], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token_);
    v1::CheckpointResponse response;
    const grpc::Status answered = stub->LoadCheckpoint(&ctx, request, &response);
    return absl::Status(static_cast<absl::StatusCode>(answered.error_code()), answered.error_message());
  }

  // Loads checkpoint `name` of `job` as load `load_id` by hand, committing it on the
  // servers in `commit_ranks` and aborting it on the others: a load that did not commit
  // on every server. OK once every server answered both phases.
  absl::Status LoadOnSome(const std::string& job, const std::string& name, uint64_t load_id,
                          const std::vector<int>& commit_ranks) const {
    for (int rank = 0; rank < static_cast<int>(addresses_.size()); ++rank) {
      const bool commits = std::find(commit_ranks.begin(), commit_ranks.end(), rank) != commit_ranks.end();
      for (const auto phase : {v1::LoadCheckpointRequest::PREPARE,
                               commits ? v1::LoadCheckpointRequest::COMMIT : v1::LoadCheckpointRequest::ABORT}) {
        if (absl::Status answered = LoadPhase(rank, job, name, load_id, phase); !answered.ok()) {
          return absl::Status(answered.code(),
                              absl::StrCat("server ", rank, " phase ", phase, ": ", answered.message()));
        }
      }
    }
    return absl::OkStatus();
  }

  // Stops server `rank` (SIGSTOP) and returns once all of its threads have stopped
  // (waitpid reports the stop): kill() returns sooner, and on a busy machine a thread
  // may still answer a call before the whole process stops. False if it did not stop.
  [[nodiscard]] bool Pause(int rank) const {
    if (pids_[rank] <= 0 || kill(pids_[rank], SIGSTOP) != 0) return false;
    int status = 0;
    return waitpid(pids_[rank], &status, WUNTRACED) == pids_[rank] && WIFSTOPPED(status);
  }
  // Lets a paused server go on (SIGCONT).
  void Resume(int rank) const {
    if (pids_[rank] > 0) kill(pids_[rank], SIGCONT);
  }
  // Sends `signal` to server `rank`.
  void Signal(int rank, int signal) const {
    if (pids_[rank] > 0) kill(pids_[rank], signal);
  }

  const std::vector<std::string>& addresses() const { return addresses_; }
  // The flags that point the `flatshard` command at these servers: --cluster and
  // --auth_token_file.
  std::vector<std::string> CommandFlags() const {
    return {"--cluster=" + absl::StrJoin(addresses_, ","), "--auth_token_file=" + token_file_};
  }

  // Runs `flatshard <command> <CommandFlags()> <args>` and, once `started(pid)` says it is
  // under way, interrupts it as Ctrl-C does (SIGINT; SIGKILL with `sigkill`) with every
  // server paused meanwhile, so that none can finish what the command asked first; then
  // lets them go on and waits for the command. Returns its wait status; an error when it
  // ended by itself first (or did not start within 60 s).
  absl::StatusOr<int> InterruptCommand(const std::string& command, const std::vector<std::string>& args,
                                       const std::function<bool(pid_t)>& started, bool sigkill = false) const {
    std::vector<std::string> argv = CommandFlags();
    argv.insert(argv.begin(), command);
    argv.insert(argv.end(), args.begin(), args.end());
    const pid_t pid = SpawnProcess(FLATSHARD_CLI_PATH, argv);
    if (pid <= 0) return absl::InternalError("cannot start the flatshard command");
    int status = 0;
    for (const absl::Time deadline = absl::Now() + absl::Seconds(60); !started(pid);) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        return absl::FailedPreconditionError(
            absl::StrCat("`flatshard ", command, "` ended (status ", status, ") before it was seen under way"));
      }
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return absl::DeadlineExceededError(absl::StrCat("`flatshard ", command, "` was not seen under way in 60 s"));
      }
      absl::SleepFor(absl::Microseconds(200));
    }
    // A command that cancels on SIGINT waits for the servers to let go.
    const bool paused = WhilePaused([&] { kill(pid, sigkill ? SIGKILL : SIGINT); });
    waitpid(pid, &status, 0);
    if (!paused) return absl::InternalError("a server did not stop");
    return status;
  }

  // Runs `body` with every server paused, then lets them go on; false if one did not stop.
  [[nodiscard]] bool WhilePaused(const std::function<void()>& body) const {
    bool paused = true;
    for (size_t rank = 0; rank < pids_.size(); ++rank) paused = Pause(static_cast<int>(rank)) && paused;
    body();
    for (size_t rank = 0; rank < pids_.size(); ++rank) Resume(static_cast<int>(rank));
    return paused;
  }

  const std::string& token() const { return token_; }
  pid_t pid(int rank) const { return pids_[rank]; }

  // Stops server `rank` as an operator does (SIGTERM) and waits up to `limit` for it to
  // exit, then kills it: its wait status and how long it took to exit. The rank has no
  // process afterwards (pid -1, which no method here signals; Restart starts one).
  std::pair<int, absl::Duration> Terminate(int rank, absl::Duration limit) {
    const absl::Time start = absl::Now();
    kill(pids_[rank], SIGTERM);
    int status = 0;
    while (waitpid(pids_[rank], &status, WNOHANG) == 0) {
      if (absl::Now() - start > limit) {
        kill(pids_[rank], SIGKILL);
        waitpid(pids_[rank], &status, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    pids_[rank] = -1;
    return {status, absl::Now() - start};
  }

 private:
  void Spawn(int servers, const std::string& checkpoint_root,
             const std::vector<std::vector<std::string>>& extra_args) {
    const std::vector<int> ports = *transport::PickFreeLoopbackPorts(2 * servers);
    for (int i = 0; i < servers; ++i) addresses_.push_back(absl::StrCat("127.0.0.1:", ports[2 * i]));
    for (int i = 0; i < servers; ++i) {
      std::vector<std::string> args = {"--listen=" + addresses_[i],
                                       absl::StrCat("--data_listen=127.0.0.1:", ports[2 * i + 1]),
                                       absl::StrCat("--rank=", i),
                                       "--cluster=" + absl::StrJoin(addresses_, ","),
                                       "--auth_token_file=" + token_file_};
      if (!checkpoint_root.empty()) args.push_back("--checkpoint_root=" + checkpoint_root);
      // FLATSHARD_TEST_MEMORY=device|pinned: every server on that tier, but where the
      // test names one (on a GPU machine, the whole suite over the GPU tiers).
      if (const char* memory = std::getenv("FLATSHARD_TEST_MEMORY"); memory != nullptr && *memory != 0) {
        args.push_back(absl::StrCat("--memory=", memory));
      }
      if (static_cast<size_t>(i) < extra_args.size()) {
        for (const std::string& arg : extra_args[i]) {
          args.push_back(absl::StrReplaceAll(arg, {{"{cluster}", absl::StrJoin(addresses_, ",")}}));
        }
      }
      pids_.push_back(SpawnServer(args));
      args_.push_back(std::move(args));
      ports_.push_back({ports[2 * i], ports[2 * i + 1]});
    }
  }

  // Until every server listens on both of its ports: false as soon as one has exited;
  // true once all listen, or when `timeout` passes (the test then sees what happens).
  bool AwaitListening(absl::Duration timeout) const {
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<bool> listening(pids_.size(), false);
    while (absl::Now() < deadline) {
      bool all = true;
      for (size_t i = 0; i < pids_.size(); ++i) {
        int status = 0;
        if (pids_[i] <= 0 || waitpid(pids_[i], &status, WNOHANG) == pids_[i]) return false;
        listening[i] = listening[i] ||
                       (ListensOn(pids_[i], ports_[i].first) && ListensOn(pids_[i], ports_[i].second));
        all = all && listening[i];
      }
      if (all) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  void StopAll() {
    for (pid_t pid : pids_) {
      if (pid > 0) kill(pid, SIGTERM);
    }
    for (pid_t pid : pids_) StopServer(pid);
    pids_.clear();
    args_.clear();
    addresses_.clear();
    ports_.clear();
  }

  std::string token_;
  std::string token_file_;  // the servers' --auth_token_file
  std::vector<std::string> addresses_;
  std::vector<pid_t> pids_;
  std::vector<std::vector<std::string>> args_;  // per server
  std::vector<std::pair<int, int>> ports_;      // per server: control, data
};

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_INTEGRATION_TEST_CLUSTER_H_
