// Gather and scatter over the CUDA IPC data plane, as a ratio to a plain device-to-device
// cudaMemcpy of the same bytes measured in the same run. Starts one flatshard-server
// with --memory=device (the binary next to this one) on 127.0.0.1, and two workers (in
// this process) whose buffers are cudaMalloc memory on the same GPU. Each call is a
// request on the worker's data connection plus the server's kernels:
//   gather                 the cast-and-write of the shard into the worker's buffer;
//   scatter                worker 0's: the copy of its gradient into a staging slot;
//   scatter + step         worker 1's, the last of the step: its copy, the reduction of
//                          both slots and the optimizer step (SGD), before it answers.
// The smallest size shows the fixed cost of a call. Median of 10 after 2 warm-ups.
//
//   build/bin/ipc_cuda_bench
#include <cuda_runtime.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cluster_status.h"
#include "flatshard/client.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/ipc.h"
#include "transport/tcp/tcp_transport.h"

extern char** environ;

namespace {

using flatshard::DType;
namespace kc = flatshard::kernels::cuda;

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

double Median(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median milliseconds of each of the phases `run` times, over 10 runs after 2 warm-ups.
// `run` returns the phases' durations.
std::vector<double> MedianMs(const std::function<std::vector<absl::Duration>()>& run) {
  for (int i = 0; i < 2; ++i) run();
  std::vector<std::vector<double>> phases;
  for (int i = 0; i < 10; ++i) {
    const std::vector<absl::Duration> times = run();
    phases.resize(times.size());
    for (size_t p = 0; p < times.size(); ++p) phases[p].push_back(absl::ToDoubleMilliseconds(times[p]));
  }
  std::vector<double> medians;
  for (auto& times : phases) medians.push_back(Median(times));
  return medians;
}

// How long `fn` takes.
absl::Duration Timed(const std::function<void()>& fn) {
  const absl::Time start = absl::Now();
  fn();
  return absl::Now() - start;
}

}  // namespace

int main(int, char** argv) {
  absl::StatusOr<int> devices = kc::DeviceCount();
  Check(devices.status(), "device count");
  if (*devices == 0) {
    std::printf("ipc_cuda_bench: no CUDA device on this machine; nothing to measure\n");
    return 0;
  }
  const std::string server_path =
      (std::filesystem::path(argv[0]).parent_path() / "flatshard-server").string();
  const std::vector<int> ports = *flatshard::transport::PickFreeLoopbackPorts(2);
  const std::string address = absl::StrCat("127.0.0.1:", ports[0]);
  std::vector<std::string> args = {server_path, "--listen=" + address, "--cluster=" + address,
                                   absl::StrCat("--data_listen=127.0.0.1:", ports[1]),
                                   "--memory=device"};
  std::vector<char*> cargs;
  for (std::string& arg : args) cargs.push_back(arg.data());
  cargs.push_back(nullptr);
  pid_t server = -1;
  if (posix_spawn(&server, cargs[0], nullptr, nullptr, cargs.data(), environ) != 0) {
    std::fprintf(stderr, "cannot start %s\n", server_path.c_str());
    return 1;
  }
  auto connect = [&](int rank) {
    absl::StatusOr<std::unique_ptr<flatshard::Client>> client;
    for (int attempt = 0; attempt < 100; ++attempt) {
      client = flatshard::Client::Connect({.servers = {address}, .token = "", .worker_rank = rank, .num_workers = 2, .job = "default",
                                           .timeout = absl::Seconds(60)});
      if (client.ok()) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    Check(client.status(), "connect");
    return *std::move(client);
  };
  auto worker0 = connect(0), worker1 = connect(1);
  Check(worker0->ConfigureJob({}), "configure");

  std::printf("CUDA IPC data plane on %s, planes: %s\n", kc::DeviceDescription(0)->c_str(),
              worker0->DataPlanes()[0].c_str());
  std::printf("| op | dtype | MiB | IPC (ms) | cudaMemcpy D2D (ms) | ratio |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: |\n");
  for (int64_t numel : {int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20, int64_t{256} << 20}) {
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
    cudaDeviceSynchronize();  // ready before a server reads it
    Check(kc::ExportDeviceBuffer(buffer->data()).status(), "CUDA IPC export of the worker buffer");
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const size_t bytes = numel * flatshard::DTypeSize(dtype);
      const absl::Span<std::byte> span(buffer->as<std::byte>(), bytes);
      const double memcpy_ms = MedianMs([&] {
        return std::vector<absl::Duration>{Timed([&] {
          cudaMemcpy(copy->data(), buffer->data(), bytes, cudaMemcpyDeviceToDevice);
          cudaDeviceSynchronize();  // a device-to-device cudaMemcpy returns before it is done
        })};
      })[0];
      const double gather_ms = MedianMs([&] {
        return std::vector<absl::Duration>{Timed([&] {
          Check(worker0->Gather(group, 0, dtype, span).get().status(), "gather");
        })};
      })[0];
      int64_t step = worker0->WaitVersion(group, 0).value();
      const std::vector<double> scatter_ms = MedianMs([&] {
        std::vector<absl::Duration> phases = {
            Timed([&] { Check(worker0->Scatter(group, step, dtype, span).get(), "scatter"); }),
            Timed([&] { Check(worker1->Scatter(group, step, dtype, span).get(), "scatter"); })};
        ++step;
        return phases;
      });
      const char* name = dtype == DType::kFloat32 ? "float32" : "bfloat16";
      const double mib = bytes / double(1 << 20);
      auto row = [&](const char* op, double ms) {
        std::printf("| %s | %s | %.0f | %.3f | %.3f | %.2fx |\n", op, name, mib, ms, memcpy_ms,
                    memcpy_ms / ms);
      };
      row("gather", gather_ms);
      row("scatter", scatter_ms[0]);
      row("scatter + step", scatter_ms[1]);
    }
  }
  const auto status = flatshard::FetchClusterStatus({address}, "", absl::Seconds(10));
  if (status[0].ok()) {
    std::printf("\nserver counted %lld gathers (%lld over CUDA IPC), %lld scatters (%lld over CUDA IPC)\n",
                static_cast<long long>(status[0]->gathers()), static_cast<long long>(status[0]->ipc_gathers()),
                static_cast<long long>(status[0]->scatters()), static_cast<long long>(status[0]->ipc_scatters()));
  }
  worker0.reset();
  worker1.reset();
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  return 0;
}
