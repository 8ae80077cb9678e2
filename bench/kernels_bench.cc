// CPU kernel throughput, as a ratio to the memory-bandwidth bound measured in the same
// run: a plain memcpy of a buffer the size of the kernel's working set gives the bytes/s
// this machine can stream; each kernel's bound is (bytes it must read + write) / that.
//
//   build/bin/kernels_bench [--benchmark_min_time=0.2]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace {

constexpr int64_t kNumel = 16 << 20;  // 64 MiB of fp32: well past the caches

std::vector<float> RandomFloats(int64_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

// Anchor: memcpy of 64 MiB (reads 64 MiB, writes 64 MiB).
void BM_MemcpyAnchor(benchmark::State& state) {
  std::vector<float> src = RandomFloats(kNumel), dst(kNumel);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kNumel * sizeof(float));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 8);
}

void BM_CastToBFloat16(benchmark::State& state) {
  std::vector<float> src = RandomFloats(kNumel);
  std::vector<uint16_t> dst(kNumel);
  for (auto _ : state) {
    flatshard::kernels::cpu::CastFloat32ToBFloat16(src, absl::MakeSpan(dst));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 6);
}

// The F16C instruction where the CPU has it (`Portable`: the loop every other CPU runs).
template <bool kPortable>
void BM_CastToFloat16(benchmark::State& state) {
  std::vector<float> src = RandomFloats(kNumel);
  std::vector<uint16_t> dst(kNumel);
  for (auto _ : state) {
    if constexpr (kPortable) {
      flatshard::kernels::cpu::CastFloat32ToFloat16Portable(src, absl::MakeSpan(dst));
    } else {
      flatshard::kernels::cpu::CastFloat32ToFloat16(src, absl::MakeSpan(dst));
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 6);
}

void BM_AccumulateBFloat16(benchmark::State& state) {
  std::vector<uint16_t> src(kNumel, 0x3F80);
  std::vector<float> dst(kNumel);
  for (auto _ : state) {
    flatshard::kernels::cpu::AccumulateBFloat16(src, absl::MakeSpan(dst));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 10);
}

void BM_AccumulateFloat32(benchmark::State& state) {
  std::vector<float> src = RandomFloats(kNumel), dst(kNumel);
  for (auto _ : state) {
    flatshard::kernels::cpu::AccumulateFloat32(src, absl::MakeSpan(dst));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 12);
}

// A step's reduction of two fp32 workers' gradients (mean): 8 bytes read, 4 written per
// element, in one pass; and the same work as the three kernels it replaced.
void BM_Reduce2Float32(benchmark::State& state) {
  std::vector<float> a = RandomFloats(kNumel), b = RandomFloats(kNumel), dst(kNumel);
  const flatshard::kernels::Contribution two[] = {{flatshard::DType::kFloat32, a.data()},
                                                  {flatshard::DType::kFloat32, b.data()}};
  for (auto _ : state) {
    if (!flatshard::kernels::cpu::Reduce(two, absl::MakeSpan(dst), 0.5f).ok()) state.SkipWithError("reduce");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 12);
}

void BM_Reduce2AsCastAccumulateScale(benchmark::State& state) {
  std::vector<float> a = RandomFloats(kNumel), b = RandomFloats(kNumel), dst(kNumel);
  for (auto _ : state) {
    std::memcpy(dst.data(), a.data(), kNumel * sizeof(float));
    flatshard::kernels::cpu::AccumulateFloat32(b, absl::MakeSpan(dst));
    flatshard::kernels::cpu::Scale(absl::MakeSpan(dst), 0.5f);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 12);
}

void BM_SquaredNorm(benchmark::State& state) {
  std::vector<float> x = RandomFloats(kNumel);
  for (auto _ : state) benchmark::DoNotOptimize(flatshard::kernels::cpu::SquaredNorm(x));
  state.SetBytesProcessed(state.iterations() * kNumel * 4);
}

BENCHMARK(BM_MemcpyAnchor)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastToBFloat16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastToFloat16<false>)->Name("BM_CastToFloat16")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastToFloat16<true>)->Name("BM_CastToFloat16Portable")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AccumulateBFloat16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AccumulateFloat32)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Reduce2Float32)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Reduce2AsCastAccumulateScale)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SquaredNorm)->Unit(benchmark::kMillisecond);

// Keeps Google Benchmark's console output and remembers bytes/s per benchmark.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      auto it = run.counters.find("bytes_per_second");
      if (it != run.counters.end()) bytes_per_second_[run.benchmark_name()] = it->second;
    }
  }
  const std::map<std::string, double>& bytes_per_second() const { return bytes_per_second_; }

 private:
  std::map<std::string, double> bytes_per_second_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  const auto& rates = reporter.bytes_per_second();
  const auto anchor = rates.find("BM_MemcpyAnchor");
  if (anchor == rates.end()) return 0;
  std::printf("\n%-32s %12s %12s\n", "kernel", "GB/s", "vs memcpy");
  for (const auto& [name, rate] : rates) {
    std::printf("%-32s %12.2f %11.2fx\n", name.c_str(), rate / 1e9, rate / anchor->second);
  }
  return 0;
}
