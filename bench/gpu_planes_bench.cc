// The GPU data planes: gathers and scatters between a worker's device buffers and a
// --memory=device server, per plane, as a ratio to the same bytes moved without
// flatshard in the same run:
//   cuda-ipc  worker and server on one GPU; reference: a device-to-device cudaMemcpy.
//   nccl      worker and server as on two nodes (NCCL_HOSTID set apart, so NCCL uses
//             its socket transport on loopback); reference: plain ncclRecv / ncclSend
//             of the same bytes between this process and a child process, same
//             transport.
// Starts one flatshard-server (the binary next to this one) on 127.0.0.1, and two
// workers per plane (in this process) whose buffers are cudaMalloc memory. Rows:
//   gather          the server's shard, cast to the dtype, into the worker's buffer;
//   scatter         worker 0's gradient into the server's staging slot;
//   scatter + step  worker 1's, the last of the step: its bytes, the reduction of both
//                   slots and the optimizer step (SGD), before it answers.
// Ratios compare gathers with the reference's receive and scatters with its send. The
// smallest size shows a call's fixed cost. Both planes also get "x8 in flight" rows: 8
// groups' gathers (or worker 0's scatters) started together and then awaited, as a
// training step issues them, by clients with max_in_flight 8 (NCCL: a pool of up to 8
// links), against 8 cudaMemcpyAsync of the same sizes and one synchronization (NCCL: 8
// receives, or sends, queued on the reference's one communicator, then one wait).
// Median of 10 after 2 warm-ups.
//
// Every transfer is waited for with flatshard::Await, polling for --spin_us (default
// flatshard::kAwaitSpin; 0: as future.get()).
//
// "server, mean (ms)", gather rows: the server's own mean time per gather of the row (its
// data_request_seconds, header in to answer out, read from its status before and after
// the row's calls, not between them: status calls there would slow the calls after
// them), after kWarmups more gathers (the first maps the worker's buffer); the rest of
// the flatshard column is the client's and the connection's, up to the mean's outliers.
//
//   build/bin/gpu_planes_bench [--planes=cuda-ipc,nccl] [--spin_us=200]
#include <cuda_runtime.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cluster_status.h"
#include "flatshard/await.h"
#include "flatshard/client.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/nccl.h"
#include "transport/tcp/tcp_transport.h"

extern char** environ;

namespace {

using flatshard::DType;
namespace kc = flatshard::kernels::cuda;

constexpr int kWarmups = 2;
constexpr int kInFlight = 8;  // groups per "in flight" row, and those clients' max_in_flight
constexpr int kRuns = 10;
const int64_t kNcclMaxNumel = int64_t{64} << 20;  // NCCL over sockets: up to 256 MiB

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

// Starts `args` with NCCL_HOSTID=`nccl_host` in its environment; returns the pid.
pid_t Spawn(std::vector<std::string> args, const std::string& nccl_host) {
  std::vector<std::string> env = {"NCCL_HOSTID=" + nccl_host};
  for (char** e = environ; *e != nullptr; ++e) {
    if (!absl::StartsWith(*e, "NCCL_HOSTID=")) env.push_back(*e);
  }
  std::vector<char*> argv, envp;
  for (std::string& arg : args) argv.push_back(arg.data());
  for (std::string& var : env) envp.push_back(var.data());
  argv.push_back(nullptr);
  envp.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) != 0) {
    std::fprintf(stderr, "cannot start %s\n", args[0].c_str());
    std::exit(1);
  }
  return pid;
}

double Median(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median milliseconds of each of the phases `run` times, over kRuns runs after
// kWarmups. `run` returns the phases' durations.
std::vector<double> MedianMs(const std::function<std::vector<absl::Duration>()>& run) {
  for (int i = 0; i < kWarmups; ++i) run();
  std::vector<std::vector<double>> phases;
  for (int i = 0; i < kRuns; ++i) {
    const std::vector<absl::Duration> times = run();
    phases.resize(times.size());
    for (size_t p = 0; p < times.size(); ++p) phases[p].push_back(absl::ToDoubleMilliseconds(times[p]));
  }
  std::vector<double> medians;
  for (auto& times : phases) medians.push_back(Median(times));
  return medians;
}

absl::Duration Timed(const std::function<void()>& fn) {
  const absl::Time start = absl::Now();
  fn();
  return absl::Now() - start;
}

// How many requests of a data-plane op ("ipc-gather", ...) a server has answered, and in
// how many seconds in all.
struct OpTotals {
  uint64_t count = 0;
  double seconds = 0;
};
OpTotals ServerOpTotals(const std::string& address, const std::string& op) {
  auto status = flatshard::FetchClusterStatus({.servers = {address}, .timeout = absl::Seconds(10)});
  Check(status[0].status(), "server status");
  for (const flatshard::v1::NamedLatency& named : status[0]->data_request_seconds()) {
    if (named.name() == op) return {named.seconds().count(), named.seconds().sum_seconds()};
  }
  return {};
}

// The server's mean milliseconds per request of `op` since `before`, once it has counted
// `requests` more (it counts a request after sending the answer, maybe after the caller
// has it).
double ServerMeanMs(const std::string& address, const std::string& op, const OpTotals& before, uint64_t requests) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (true) {
    const OpTotals now = ServerOpTotals(address, op);
    if (now.count >= before.count + requests || absl::Now() > give_up) {
      return now.count == before.count ? 0 : 1e3 * (now.seconds - before.seconds) / (now.count - before.count);
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// The sizes (bytes) of the rows, in order: fp32 then bf16 per element count.
std::vector<int64_t> NumelsFor(const std::string& plane) {
  std::vector<int64_t> numels = {int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20, int64_t{256} << 20};
  if (plane == "nccl") numels.erase(std::remove_if(numels.begin(), numels.end(), [](int64_t n) { return n > kNcclMaxNumel; }), numels.end());
  return numels;
}
const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16};

// Elements per group of the "in flight" rows (kInFlight groups each, float32).
std::vector<int64_t> InFlightNumelsFor(const std::string& plane) {
  if (plane == "nccl") return {int64_t{4} << 20, int64_t{16} << 20};  // 128 and 512 MiB in all
  return {int64_t{4} << 20, int64_t{16} << 20, int64_t{64} << 20};
}

// The reference's other end (a child process): per size, kWarmups + kRuns sends, then as
// many receives, matching the parent's receives and sends.
int NcclPeer(const std::string& unique_id_hex) {
  Check(cudaSetDevice(0) == cudaSuccess ? absl::OkStatus() : absl::InternalError("cudaSetDevice"), "device");
  auto comm = kc::NcclCommunicator::Create(absl::HexStringToBytes(unique_id_hex), 2, 0, absl::Seconds(60));
  Check(comm.status(), "peer join");
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  auto buffer = kc::DeviceMemory::Allocate(kNcclMaxNumel * 4, "peer buffer");
  Check(buffer.status(), "peer alloc");
  for (int64_t numel : NumelsFor("nccl")) {
    for (DType dtype : kDtypes) {
      const size_t bytes = numel * flatshard::DTypeSize(dtype);
      for (int i = 0; i < kWarmups + kRuns; ++i) {
        Check((*comm)->Send(buffer->data(), bytes, 1, stream), "peer send");
        Check((*comm)->Wait(stream, absl::Seconds(60)), "peer send");
      }
      for (int i = 0; i < kWarmups + kRuns; ++i) {
        Check((*comm)->Recv(buffer->data(), bytes, 1, stream), "peer recv");
        Check((*comm)->Wait(stream, absl::Seconds(60)), "peer recv");
      }
    }
  }
  // The "in flight" references: kInFlight transfers in one NCCL group (a non-blocking
  // communicator takes the next operation only once the last is enqueued), then one wait
  // (all from and into the same buffer: only the bytes moved matter).
  for (int64_t numel : InFlightNumelsFor("nccl")) {
    const size_t bytes = numel * 4;
    for (bool send : {true, false}) {
      for (int i = 0; i < kWarmups + kRuns; ++i) {
        Check((*comm)->GroupStart(), "peer in flight");
        for (int g = 0; g < kInFlight; ++g) {
          Check(send ? (*comm)->Send(buffer->data(), bytes, 1, stream) : (*comm)->Recv(buffer->data(), bytes, 1, stream),
                "peer in flight");
        }
        Check((*comm)->GroupEnd(), "peer in flight");
        Check((*comm)->Wait(stream, absl::Seconds(120)), "peer in flight");
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> planes = {"cuda-ipc", "nccl"};
  absl::Duration spin = flatshard::kAwaitSpin;  // how each transfer is waited for
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    int64_t spin_us = 0;
    if (absl::StartsWith(arg, "--nccl_peer=")) return NcclPeer(arg.substr(12));
    if (absl::StartsWith(arg, "--planes=")) {
      planes = absl::StrSplit(arg.substr(9), ',');
    } else if (absl::StartsWith(arg, "--spin_us=") && absl::SimpleAtoi(arg.substr(10), &spin_us) && spin_us >= 0) {
      spin = absl::Microseconds(spin_us);
    } else {
      std::fprintf(stderr, "usage: %s [--planes=cuda-ipc,nccl] [--spin_us=N]\n", argv[0]);
      return 2;
    }
  }
  absl::StatusOr<int> devices = kc::DeviceCount();
  Check(devices.status(), "device count");
  if (*devices == 0) {
    std::printf("gpu_planes_bench: no CUDA device on this machine; nothing to measure\n");
    return 0;
  }
  if (std::find(planes.begin(), planes.end(), "nccl") != planes.end() && !kc::NcclVersion().ok()) {
    std::printf("gpu_planes_bench: NCCL does not load here (%s); measuring CUDA IPC only\n",
                kc::NcclVersion().status().ToString().c_str());
    planes.erase(std::remove(planes.begin(), planes.end(), "nccl"), planes.end());
  }
  // As on separate nodes: this process, the server and the reference's peer each get a
  // host id of their own; NCCL's socket transport runs on loopback.
  setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  setenv("NCCL_HOSTID", "flatshard-bench-worker", 1);
  const std::string self = argv[0];
  const std::string server_path = (std::filesystem::path(self).parent_path() / "flatshard-server").string();
  const std::vector<int> ports = *flatshard::transport::PickFreeLoopbackPorts(2);
  const std::string address = absl::StrCat("127.0.0.1:", ports[0]);
  const pid_t server = Spawn({server_path, "--listen=" + address, "--cluster=" + address,
                              absl::StrCat("--data_listen=127.0.0.1:", ports[1]), "--memory=device"},
                             "flatshard-bench-server");
  // `in_flight`: the client's max_in_flight (concurrent transfers per server).
  auto connect = [&](int rank, const std::string& job, flatshard::DevicePlane plane, int in_flight = 2) {
    absl::StatusOr<std::unique_ptr<flatshard::Client>> client;
    for (int attempt = 0; attempt < 100; ++attempt) {
      client = flatshard::Client::Connect({.servers = {address}, .token = "", .worker_rank = rank, .num_workers = 2,
                                           .job = job, .timeout = absl::Seconds(60),
                                           .max_in_flight = in_flight, .device_plane = plane});
      if (client.ok()) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    Check(client.status(), "connect");
    return *std::move(client);
  };

  std::printf("GPU data planes on %s\n", kc::DeviceDescription(0)->c_str());
  std::printf("| plane | op | dtype | MiB | flatshard (ms) | server, mean (ms) | reference (ms) | ratio |\n");
  std::printf("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |\n");
  // One row; `server_ms` < 0: not measured.
  auto print_row = [](const std::string& plane, const std::string& op, const char* dtype, double mib, double ms,
                      double server_ms, double reference) {
    const std::string server = server_ms < 0 ? "-" : absl::StrFormat("%.3f", server_ms);
    std::printf("| %s | %s | %s | %.0f | %.3f | %s | %.3f | %.2fx |\n", plane.c_str(), op.c_str(), dtype, mib, ms,
                server.c_str(), reference, reference / ms);
  };
  for (const std::string& plane : planes) {
    const bool nccl = plane == "nccl";
    const flatshard::DevicePlane choice = nccl ? flatshard::DevicePlane::kNccl : flatshard::DevicePlane::kCudaIpc;
    auto worker0 = connect(0, plane, choice), worker1 = connect(1, plane, choice);
    Check(worker0->ConfigureJob({}), "configure");
    if (worker0->DataPlanes()[0] != plane) {
      std::fprintf(stderr, "the client chose %s, not %s\n", worker0->DataPlanes()[0].c_str(), plane.c_str());
      return 1;
    }
    std::unique_ptr<kc::NcclCommunicator> reference;  // with the child peer
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    pid_t peer = -1;
    if (nccl) {
      const std::string unique_id = *kc::NcclCommunicator::NewUniqueId();
      peer = Spawn({self, "--nccl_peer=" + absl::BytesToHexString(unique_id)}, "flatshard-bench-peer");
      auto comm = kc::NcclCommunicator::Create(unique_id, 2, 1, absl::Seconds(60));
      Check(comm.status(), "reference join");
      reference = *std::move(comm);
    }
    for (int64_t numel : NumelsFor(plane)) {
      const std::string group = absl::StrCat("g", numel);
      for (auto& worker : {worker0.get(), worker1.get()}) {
        Check(worker->RegisterGroup(group, {{"w", {numel}, DType::kFloat32}}, 0,
                                    flatshard::SgdOptions{.lr = 1e-3}).status(), "register");
      }
      Check(worker0->InitGroupFromSeed(group, 1), "init");
      absl::StatusOr<kc::DeviceMemory> buffer = kc::DeviceMemory::Allocate(numel * 4, "worker buffer");
      absl::StatusOr<kc::DeviceMemory> copy = kc::DeviceMemory::Allocate(numel * 4, "copy target");
      Check(buffer.status(), "alloc");
      Check(copy.status(), "alloc");
      cudaMemset(buffer->data(), 0x3c, numel * 4);  // small positive floats, not zeros
      cudaDeviceSynchronize();                      // ready before a server reads it
      for (DType dtype : kDtypes) {
        const size_t bytes = numel * flatshard::DTypeSize(dtype);
        const absl::Span<std::byte> span(buffer->as<std::byte>(), bytes);
        // The reference: [receive, send] for NCCL, [copy, copy] for CUDA IPC.
        std::vector<double> reference_ms;
        if (nccl) {
          for (bool receive : {true, false}) {
            reference_ms.push_back(MedianMs([&] {
              return std::vector<absl::Duration>{Timed([&] {
                Check(receive ? reference->Recv(copy->data(), bytes, 0, stream)
                              : reference->Send(buffer->data(), bytes, 0, stream), "reference");
                Check(reference->Wait(stream, absl::Seconds(60)), "reference");
              })};
            })[0]);
          }
        } else {
          const double copy_ms = MedianMs([&] {
            return std::vector<absl::Duration>{Timed([&] {
              cudaMemcpy(copy->data(), buffer->data(), bytes, cudaMemcpyDeviceToDevice);
              cudaDeviceSynchronize();  // a device-to-device cudaMemcpy returns before it is done
            })};
          })[0];
          reference_ms = {copy_ms, copy_ms};
        }
        const std::string gather_op = nccl ? "nccl-gather" : "ipc-gather";
        auto gather = [&] { Check(flatshard::Await(worker0->Gather(group, 0, dtype, span), spin).status(), "gather"); };
        for (int i = 0; i < kWarmups; ++i) gather();
        const OpTotals before = ServerOpTotals(address, gather_op);
        const double gather_ms = MedianMs([&] { return std::vector<absl::Duration>{Timed(gather)}; })[0];
        const double gather_server_ms = ServerMeanMs(address, gather_op, before, kWarmups + kRuns);
        int64_t step = worker0->WaitVersion(group, 0).value();
        const std::vector<double> scatter_ms = MedianMs([&] {
          std::vector<absl::Duration> phases = {
              Timed([&] { Check(flatshard::Await(worker0->Scatter(group, step, dtype, span), spin), "scatter"); }),
              Timed([&] { Check(flatshard::Await(worker1->Scatter(group, step, dtype, span), spin), "scatter"); })};
          ++step;
          return phases;
        });
        const char* name = dtype == DType::kFloat32 ? "float32" : "bfloat16";
        const double mib = bytes / double(1 << 20);
        print_row(plane, "gather", name, mib, gather_ms, gather_server_ms, reference_ms[0]);
        print_row(plane, "scatter", name, mib, scatter_ms[0], -1, reference_ms[1]);
        print_row(plane, "scatter + step", name, mib, scatter_ms[1], -1, reference_ms[1]);
      }
    }
    {
      // Clients that run kInFlight transfers per server at once (the default is 2).
      worker0 = connect(0, "in-flight-" + plane, choice, kInFlight);
      worker1 = connect(1, "in-flight-" + plane, choice, kInFlight);
      Check(worker0->ConfigureJob({}), "configure");
      for (int64_t numel : InFlightNumelsFor(plane)) {
        std::vector<std::string> groups;
        for (int g = 0; g < kInFlight; ++g) {
          groups.push_back(absl::StrCat("p", numel, "_", g));
          for (auto& worker : {worker0.get(), worker1.get()}) {
            Check(worker->RegisterGroup(groups.back(), {{"w", {numel}, DType::kFloat32}}, 0,
                                        flatshard::SgdOptions{.lr = 1e-3}).status(), "register");
          }
          Check(worker0->InitGroupFromSeed(groups.back(), 1), "init");
        }
        const size_t bytes = numel * 4;
        absl::StatusOr<kc::DeviceMemory> buffer = kc::DeviceMemory::Allocate(bytes * kInFlight, "worker buffers");
        absl::StatusOr<kc::DeviceMemory> copy = kc::DeviceMemory::Allocate(bytes * kInFlight, "copy targets");
        Check(buffer.status(), "alloc");
        Check(copy.status(), "alloc");
        cudaMemset(buffer->data(), 0x3c, bytes * kInFlight);
        cudaDeviceSynchronize();
        auto span = [&](int g) { return absl::Span<std::byte>(buffer->as<std::byte>() + g * bytes, bytes); };
        // [gathers' reference, scatters' reference]: the same bytes without flatshard.
        std::vector<double> reference_ms;
        if (nccl) {
          for (bool receive : {true, false}) {  // the peer sends first, then receives
            reference_ms.push_back(MedianMs([&] {
              return std::vector<absl::Duration>{Timed([&] {
                Check(reference->GroupStart(), "reference");
                for (int g = 0; g < kInFlight; ++g) {
                  Check(receive ? reference->Recv(copy->as<std::byte>() + g * bytes, bytes, 0, stream)
                                : reference->Send(buffer->as<std::byte>() + g * bytes, bytes, 0, stream),
                        "reference");
                }
                Check(reference->GroupEnd(), "reference");
                Check(reference->Wait(stream, absl::Seconds(120)), "reference");
              })};
            })[0]);
          }
        } else {
          const double copy_ms = MedianMs([&] {
            return std::vector<absl::Duration>{Timed([&] {
              for (int g = 0; g < kInFlight; ++g) {
                cudaMemcpyAsync(copy->as<std::byte>() + g * bytes, buffer->as<std::byte>() + g * bytes, bytes,
                                cudaMemcpyDeviceToDevice, stream);
              }
              cudaStreamSynchronize(stream);
            })};
          })[0];
          reference_ms = {copy_ms, copy_ms};
        }
        const double gather_ms = MedianMs([&] {
          return std::vector<absl::Duration>{Timed([&] {
            std::vector<std::future<absl::StatusOr<int64_t>>> pending;
            for (int g = 0; g < kInFlight; ++g) pending.push_back(worker0->Gather(groups[g], 0, DType::kFloat32, span(g)));
            for (auto& p : pending) Check(flatshard::Await(p, spin).status(), "gather");
          })};
        })[0];
        int64_t step = 0;
        const double scatter_ms = MedianMs([&] {
          std::vector<absl::Duration> phases = {Timed([&] {
            std::vector<std::future<absl::Status>> pending;
            for (int g = 0; g < kInFlight; ++g) pending.push_back(worker0->Scatter(groups[g], step, DType::kFloat32, span(g)));
            for (auto& p : pending) Check(flatshard::Await(p, spin), "scatter");
          })};
          for (int g = 0; g < kInFlight; ++g) {
            Check(flatshard::Await(worker1->Scatter(groups[g], step, DType::kFloat32, span(g)), spin), "scatter");
          }
          ++step;
          return phases;
        })[0];
        const double mib = kInFlight * bytes / double(1 << 20);
        print_row(plane, absl::StrCat("gather x", kInFlight, " in flight"), "float32", mib, gather_ms, -1,
                  reference_ms[0]);
        print_row(plane, absl::StrCat("scatter x", kInFlight, " in flight"), "float32", mib, scatter_ms, -1,
                  reference_ms[1]);
      }
    }
    if (peer > 0) waitpid(peer, nullptr, 0);
    reference.reset();
    cudaStreamDestroy(stream);
  }
  const auto status = flatshard::FetchClusterStatus({.servers = {address}, .timeout = absl::Seconds(10)});
  if (status[0].ok()) {
    const auto& s = *status[0];
    std::printf("\nserver counted %lld gathers (%lld over CUDA IPC, %lld over NCCL), %lld scatters "
                "(%lld over CUDA IPC, %lld over NCCL)\n",
                static_cast<long long>(s.gathers()), static_cast<long long>(s.ipc_gathers()),
                static_cast<long long>(s.nccl_gathers()), static_cast<long long>(s.scatters()),
                static_cast<long long>(s.ipc_scatters()), static_cast<long long>(s.nccl_scatters()));
  }
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  return 0;
}
