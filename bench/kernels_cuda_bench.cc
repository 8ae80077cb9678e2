// GPU kernel throughput as a ratio to the device's memory bandwidth, measured in the same
// run: a device-to-device cudaMemcpy of 1 GiB (bytes read + written over its time) is
// the anchor, and each kernel's bound is (the fewest bytes it must read + write) / that
// bandwidth. Fused Adam/AdamW: 28 bytes per parameter (p, g, m, v read; p, m, v
// written). Times are the median of 20 launches timed with CUDA events after 3 warm-ups,
// on random data, with working sets far past the L2 cache.
//
//   build/bin/kernels_cuda_bench [--json=results.json] [--quick]
//
// --json writes the fused-update rows for bench/torch_adamw_bench.py, which times
// torch.optim.AdamW(fused=True) on the same sizes and prints them side by side.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/kernels.h"

namespace {

namespace kc = flatshard::kernels::cuda;
using flatshard::DType;

#define CHECK_CUDA(expr)                                                               \
  do {                                                                                 \
    const cudaError_t err_ = (expr);                                                   \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(err_));        \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

void CheckOk(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::exit(1);
  }
}

kc::DeviceMemory Alloc(size_t bytes) {
  absl::StatusOr<kc::DeviceMemory> memory = kc::DeviceMemory::Allocate(bytes, "benchmark buffer");
  CheckOk(memory.status());
  return std::move(*memory);
}

// Fills `n` floats with random values (normal, or uniform in (0, 1) for second moments)
// by tiling a 16 Mi-element random block: real data, not zeros.
void FillRandom(float* device, int64_t n, bool positive, unsigned seed) {
  const int64_t block = std::min<int64_t>(n, 16 << 20);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(1e-4f, 1.0f);
  std::vector<float> host(block);
  for (float& x : host) x = positive ? uniform(rng) : normal(rng);
  for (int64_t at = 0; at < n; at += block) {
    CHECK_CUDA(cudaMemcpy(device + at, host.data(), std::min(block, n - at) * sizeof(float),
                          cudaMemcpyHostToDevice));
  }
}

// Median milliseconds of `run` over 20 timed launches on `stream`, after 3 warm-ups.
double MedianMs(cudaStream_t stream, const std::function<void()>& run) {
  for (int i = 0; i < 3; ++i) run();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    run();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Row {
  std::string kernel;
  int64_t numel;
  double bytes_per_element;
  double ms;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--json=")) {
      json_path = arg.substr(7);
    } else if (arg == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--json=PATH] [--quick]\n", argv[0]);
      return 2;
    }
  }
  absl::StatusOr<int> devices = kc::DeviceCount();
  CheckOk(devices.status());
  if (*devices == 0) {
    std::printf("kernels_cuda_bench: no CUDA device on this machine; nothing to measure\n");
    return 0;
  }
  absl::StatusOr<std::string> description = kc::DeviceDescription(0);
  CheckOk(description.status());
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  // Anchor: device-to-device copy of 1 GiB.
  const size_t copy_bytes = size_t{1} << 30;
  kc::DeviceMemory copy_src = Alloc(copy_bytes), copy_dst = Alloc(copy_bytes);
  FillRandom(copy_src.as<float>(), copy_bytes / 4, false, 1);
  const double copy_ms = MedianMs(stream, [&] {
    CHECK_CUDA(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), copy_bytes,
                               cudaMemcpyDeviceToDevice, stream));
  });
  const double copy_gbps = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  copy_src = {};
  copy_dst = {};

  std::vector<int64_t> sizes = {int64_t{16} << 20, int64_t{64} << 20, int64_t{256} << 20};
  if (quick) sizes = {int64_t{16} << 20};
  std::vector<Row> rows;
  for (int64_t n : sizes) {
    kc::DeviceMemory p = Alloc(n * 4), g = Alloc(n * 4), m = Alloc(n * 4), v = Alloc(n * 4),
                     half = Alloc(n * 2), scalar = Alloc(16);
    FillRandom(p.as<float>(), n, false, 2);
    FillRandom(g.as<float>(), n, false, 3);
    FillRandom(m.as<float>(), n, false, 4);
    FillRandom(v.as<float>(), n, true, 5);
    CheckOk(kc::Cast(DType::kFloat32, g.data(), DType::kBFloat16, half.data(), n, stream));
    const flatshard::kernels::AdamHyperparams adamw{
        .lr = 1e-3f, .weight_decay = 0.01f, .decoupled_weight_decay = true};
    const flatshard::kernels::AdamHyperparams adam{.lr = 1e-3f};
    const flatshard::kernels::SgdHyperparams sgd{.lr = 1e-2f, .momentum = 0.9f, .nesterov = true};
    int64_t step = 1;
    auto time = [&](const std::string& name, double bytes, const std::function<absl::Status()>& f) {
      rows.push_back({name, n, bytes, MedianMs(stream, [&] { CheckOk(f()); })});
    };
    time("AdamW (fused)", 28, [&] {
      return kc::AdamStep(adamw, step++, p.as<float>(), g.as<float>(), m.as<float>(), v.as<float>(),
                          nullptr, n, stream);
    });
    time("Adam (fused)", 28, [&] {
      return kc::AdamStep(adam, step++, p.as<float>(), g.as<float>(), m.as<float>(), v.as<float>(),
                          nullptr, n, stream);
    });
    time("SGD nesterov", 20, [&] {
      return kc::SgdStep(sgd, false, p.as<float>(), g.as<float>(), m.as<float>(), n, stream);
    });
    time("cast fp32->bf16", 6, [&] {
      return kc::Cast(DType::kFloat32, p.data(), DType::kBFloat16, half.data(), n, stream);
    });
    time("cast fp32->fp16", 6, [&] {
      return kc::Cast(DType::kFloat32, p.data(), DType::kFloat16, half.data(), n, stream);
    });
    time("accumulate bf16", 10, [&] {
      return kc::Accumulate(DType::kBFloat16, half.data(), g.as<float>(), n, stream);
    });
    time("accumulate fp32", 12, [&] {
      return kc::Accumulate(DType::kFloat32, m.data(), g.as<float>(), n, stream);
    });
    time("scale", 8, [&] { return kc::Scale(g.as<float>(), n, 0.999f, stream); });
    // A step's reduction of 2 workers' fp32 gradients (mean): 8 bytes read, 4 written per
    // element; the same work as the three kernels it replaced, for comparison.
    const flatshard::kernels::Contribution two[] = {{DType::kFloat32, m.data()},
                                                    {DType::kFloat32, v.data()}};
    time("reduce 2 fp32 (mean)", 12, [&] { return kc::Reduce(two, g.as<float>(), n, 0.5f, stream); });
    time("reduce as cast+accumulate+scale", 12, [&] {
      FLATSHARD_RETURN_IF_ERROR(kc::Cast(DType::kFloat32, m.data(), DType::kFloat32, g.data(), n, stream));
      FLATSHARD_RETURN_IF_ERROR(kc::Accumulate(DType::kFloat32, v.data(), g.as<float>(), n, stream));
      return kc::Scale(g.as<float>(), n, 0.5f, stream);
    });
    time("squared norm", 4, [&] {
      return kc::SquaredNorm(g.as<float>(), n, scalar.as<double>(), stream);
    });
  }

  std::printf("GPU kernels on %s\n", description->c_str());
  std::printf("anchor: device-to-device copy of 1 GiB: %.3f ms, %.0f GB/s (read + write)\n\n",
              copy_ms, copy_gbps);
  std::printf("| kernel | params | bytes/param | time (ms) | GB/s | ratio to copy bound |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Row& row : rows) {
    const double gbps = row.bytes_per_element * row.numel / (row.ms * 1e-3) / 1e9;
    std::printf("| %s | %lldM | %.0f | %.3f | %.0f | %.2fx |\n", row.kernel.c_str(),
                static_cast<long long>(row.numel >> 20), row.bytes_per_element, row.ms, gbps,
                gbps / copy_gbps);
  }
  if (!json_path.empty()) {
    FILE* out = std::fopen(json_path.c_str(), "w");
    if (out == nullptr) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::fprintf(out, "{\"device\": \"%s\", \"copy_gbps\": %.3f, \"rows\": [", description->c_str(),
                 copy_gbps);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(out, "%s{\"kernel\": \"%s\", \"numel\": %lld, \"ms\": %.6f}", i ? ", " : "",
                   rows[i].kernel.c_str(), static_cast<long long>(rows[i].numel), rows[i].ms);
    }
    std::fprintf(out, "]}\n");
    std::fclose(out);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
