// The CUDA kernels against the CPU kernels (themselves tested against float64 and
// PyTorch's rules) on fresh random inputs, at sizes that exercise the 16-byte vector
// path, the element-wise tail and misaligned pointers. Outputs are poisoned before each
// launch, so an element the kernel never wrote fails. Casts, accumulation, reduction,
// scaling and the optimizers must agree bit for bit (they share their element code with the CPU);
// the squared norm to 1e-12 relative (double sums in another order), max |x| exactly.
// Skips, with the reason, on a machine without a CUDA device.
#include "kernels/cuda/kernels.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/accumulate.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/scale.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"

namespace flatshard::kernels::cuda {
namespace {

constexpr unsigned char kPoison = 0xA5;

class CudaKernelsTest : public ::testing::TestWithParam<int64_t /*offset*/> {
 protected:
  void SetUp() override {
    absl::StatusOr<int> count = DeviceCount();
    ASSERT_TRUE(count.ok()) << count.status();
    if (*count == 0) GTEST_SKIP() << "no CUDA device (or no driver) on this machine";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // A device copy of `host` placed `GetParam()` elements past a 256-byte boundary, so
  // offset 1 defeats the vector path.
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    absl::StatusOr<DeviceMemory> memory =
        DeviceMemory::Allocate((host.size() + 8) * sizeof(T), "test buffer");
    EXPECT_TRUE(memory.ok()) << memory.status();
    T* data = memory->as<T>() + GetParam();
    EXPECT_EQ(cudaMemset(memory->data(), kPoison, memory->size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    buffers_.push_back(std::move(*memory));
    return data;
  }
  template <typename T>
  T* Poisoned(size_t n) {
    std::vector<T> poison(n);
    std::memset(poison.data(), kPoison, n * sizeof(T));
    return Upload(poison);
  }
  template <typename T>
  std::vector<T> Download(const T* device, size_t n) {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

  cudaStream_t stream_ = nullptr;
  std::vector<DeviceMemory> buffers_;
  std::mt19937 rng_{std::random_device{}()};
};

const int64_t kSizes[] = {0, 1, 3, 4, 5, 1023, (1 << 20) + 7};

std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float scale, bool specials = false) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& x : values) x = normal(rng);
  if (specials && n >= 8) {
    const float s[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(), 1e-40f, -0.0f, 65519.0f, 65520.0f, 3e38f};
    for (size_t i = 0; i < 8; ++i) values[(i * 7919) % n] = s[i];
  }
  return values;
}

template <typename T>
void ExpectBitwiseEqual(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << what << ": element " << i << " of " << got.size() << " differs: " << got[i] << " vs "
        << want[i];
  }
}

TEST_P(CudaKernelsTest, CastsToAndFrom16BitFloatsAsTheCpuDoes) {
  for (DType half : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t n : kSizes) {
      const std::vector<float> src = RandomFloats(rng_, n, 100.0f, /*specials=*/true);
      std::vector<uint16_t> want(n);
      ASSERT_TRUE(cpu::Cast(DType::kFloat32, src.data(), half, want.data(), n).ok());
      const float* d_src = Upload(src);
      uint16_t* d_dst = Poisoned<uint16_t>(n);
      ASSERT_TRUE(Cast(DType::kFloat32, d_src, half, d_dst, n, stream_).ok());
      ExpectBitwiseEqual(Download(d_dst, n), want, DTypeName(half).data());
    }
    // Narrowing of a sweep over every exponent (subnormal results, overflow, NaN
    // payloads) and of every tie: the midpoints between neighbouring 16-bit values.
    std::vector<float> sweep;
    for (uint64_t bits = rng_() % 997; bits <= 0xFFFFFFFFu; bits += 4099) {
      sweep.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits)));
    }
    for (uint32_t h = 0; h < 0x7C00u; ++h) {
      const uint16_t pair[2] = {static_cast<uint16_t>(h), static_cast<uint16_t>(h + 1)};
      float lo_hi[2] = {};
      ASSERT_TRUE(cpu::Cast(half, pair, DType::kFloat32, lo_hi, 2).ok());
      const float lo = lo_hi[0], hi = lo_hi[1];
      if (std::isfinite(hi)) {
        sweep.push_back((lo + hi) / 2);  // exact in float32
        sweep.push_back(-(lo + hi) / 2);
      }
    }
    std::vector<uint16_t> want_sweep(sweep.size());
    ASSERT_TRUE(cpu::Cast(DType::kFloat32, sweep.data(), half, want_sweep.data(), sweep.size()).ok());
    uint16_t* d_sweep = Poisoned<uint16_t>(sweep.size());
    ASSERT_TRUE(Cast(DType::kFloat32, Upload(sweep), half, d_sweep, sweep.size(), stream_).ok());
    ExpectBitwiseEqual(Download(d_sweep, sweep.size()), want_sweep, "narrowing sweep");
    // Widening: every 16-bit pattern, NaN payloads included.
    std::vector<uint16_t> all(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    std::vector<float> want(all.size());
    ASSERT_TRUE(cpu::Cast(half, all.data(), DType::kFloat32, want.data(), all.size()).ok());
    float* d_dst = Poisoned<float>(all.size());
    ASSERT_TRUE(Cast(half, Upload(all), DType::kFloat32, d_dst, all.size(), stream_).ok());
    ExpectBitwiseEqual(Download(d_dst, all.size()), want, "widening");
  }
}

TEST_P(CudaKernelsTest, AccumulatesEveryDtypeAsTheCpuDoes) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t n : kSizes) {
      std::vector<float> acc = RandomFloats(rng_, n, 1.0f);
      const std::vector<float> grad32 = RandomFloats(rng_, n, 0.5f);
      std::vector<uint16_t> grad16(n);
      if (dtype != DType::kFloat32) {
        ASSERT_TRUE(cpu::Cast(DType::kFloat32, grad32.data(), dtype, grad16.data(), n).ok());
      }
      const void* host_grad = dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data())
                                                       : static_cast<const void*>(grad16.data());
      const void* d_grad = dtype == DType::kFloat32 ? static_cast<const void*>(Upload(grad32))
                                                    : static_cast<const void*>(Upload(grad16));
      float* d_acc = Upload(acc);
      ASSERT_TRUE(Accumulate(dtype, d_grad, d_acc, n, stream_).ok());
      ASSERT_TRUE(cpu::Accumulate(dtype, host_grad, absl::MakeSpan(acc)).ok());
      ExpectBitwiseEqual(Download(d_acc, n), acc, DTypeName(dtype).data());
    }
  }
}

// Mixed dtypes; 11 workers take two launches (8 sources each at most).
TEST_P(CudaKernelsTest, ReducesMixedContributionsAsTheCpuDoes) {
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int workers : {1, 2, 3, 11}) {
    for (int64_t n : kSizes) {
      std::vector<std::vector<float>> f32(workers);
      std::vector<std::vector<uint16_t>> bits(workers);
      std::vector<Contribution> host, device;
      for (int w = 0; w < workers; ++w) {
        const DType dtype = dtypes[(w + rng_()) % 3];
        f32[w] = RandomFloats(rng_, n, 2.0f);
        if (dtype == DType::kFloat32) {
          host.push_back({dtype, f32[w].data()});
          device.push_back({dtype, Upload(f32[w])});
        } else {
          bits[w].resize(n);
          ASSERT_TRUE(cpu::Cast(DType::kFloat32, f32[w].data(), dtype, bits[w].data(), n).ok());
          host.push_back({dtype, bits[w].data()});
          device.push_back({dtype, Upload(bits[w])});
        }
      }
      for (float alpha : {1.0f, 1.0f / static_cast<float>(workers)}) {
        std::vector<float> want(n);
        ASSERT_TRUE(cpu::Reduce(host, absl::MakeSpan(want), alpha).ok());
        float* d_dst = Poisoned<float>(n);
        ASSERT_TRUE(Reduce(device, d_dst, n, alpha, stream_).ok());
        ExpectBitwiseEqual(Download(d_dst, n), want, "reduce");
      }
    }
  }
  float* d_dst = Poisoned<float>(4);
  EXPECT_EQ(Reduce({}, d_dst, 4, 1.0f, stream_).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(CudaKernelsTest, ScalesAsTheCpuDoes) {
  for (int64_t n : kSizes) {
    std::vector<float> x = RandomFloats(rng_, n, 3.0f);
    float* d_x = Upload(x);
    ASSERT_TRUE(Scale(d_x, n, 0.337f, stream_).ok());
    cpu::Scale(absl::MakeSpan(x), 0.337f);
    ExpectBitwiseEqual(Download(d_x, n), x, "scale");
  }
}

TEST_P(CudaKernelsTest, NormsAgreeWithTheCpu) {
  for (int64_t n : kSizes) {
    std::vector<float> x = RandomFloats(rng_, n, 2.0f);
    const float* d_x = Upload(x);
    double* d_sq = Poisoned<double>(1);
    float* d_max = Poisoned<float>(1);
    ASSERT_TRUE(SquaredNorm(d_x, n, d_sq, stream_).ok());
    ASSERT_TRUE(MaxAbs(d_x, n, d_max, stream_).ok());
    const double want = cpu::SquaredNorm(x);
    EXPECT_NEAR(Download(d_sq, 1)[0], want, 1e-12 * want) << n;
    EXPECT_EQ(Download(d_max, 1)[0], cpu::MaxAbs(x)) << n;
    if (n > 2) {  // NaN propagates through both norms
      x[n / 2] = std::numeric_limits<float>::quiet_NaN();
      const float* d_nan = Upload(x);
      ASSERT_TRUE(SquaredNorm(d_nan, n, d_sq, stream_).ok());
      ASSERT_TRUE(MaxAbs(d_nan, n, d_max, stream_).ok());
      EXPECT_TRUE(std::isnan(Download(d_sq, 1)[0]));
      EXPECT_TRUE(std::isnan(Download(d_max, 1)[0]));
    }
  }
}

TEST_P(CudaKernelsTest, SgdStepsMatchTheCpuBitForBit) {
  const SgdHyperparams configs[] = {
      {.lr = 0.1f},
      {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f},
      {.lr = 0.05f, .momentum = 0.9f, .dampening = 0.1f},
      {.lr = 0.02f, .momentum = 0.8f, .weight_decay = 1e-3f, .nesterov = true},
  };
  for (const SgdHyperparams& hp : configs) {
    for (int64_t n : kSizes) {
      std::vector<float> p = RandomFloats(rng_, n, 1.0f), buf(n, 0.0f);
      float* d_p = Upload(p);
      float* d_buf = Poisoned<float>(n);  // never read on the first step
      for (int step = 1; step <= 4; ++step) {
        const std::vector<float> g = RandomFloats(rng_, n, 0.1f);
        ASSERT_TRUE(SgdStep(hp, step == 1, d_p, Upload(g), d_buf, n, stream_).ok());
        cpu::SgdStep(hp, step == 1, absl::MakeSpan(p), g, absl::MakeSpan(buf));
      }
      ExpectBitwiseEqual(Download(d_p, n), p, "sgd param");
      if (hp.momentum != 0.0f) ExpectBitwiseEqual(Download(d_buf, n), buf, "sgd momentum");
    }
  }
}

TEST_P(CudaKernelsTest, AdamStepsMatchTheCpuBitForBit) {
  const AdamHyperparams configs[] = {
      {.lr = 1e-2f},
      {.lr = 1e-2f, .weight_decay = 0.1f},                                   // Adam + L2
      {.lr = 1e-3f, .weight_decay = 0.01f, .decoupled_weight_decay = true},  // AdamW
      {.lr = 1e-2f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-6f, .amsgrad = true},
  };
  for (const AdamHyperparams& hp : configs) {
    for (int64_t n : kSizes) {
      std::vector<float> p = RandomFloats(rng_, n, 1.0f), m(n, 0.0f), v(n, 0.0f), v_max(n, 0.0f);
      float* d_p = Upload(p);
      float* d_m = Upload(m);
      float* d_v = Upload(v);
      float* d_vmax = hp.amsgrad ? Upload(v_max) : nullptr;
      for (int step = 1; step <= 5; ++step) {
        const std::vector<float> g = RandomFloats(rng_, n, 0.1f);
        ASSERT_TRUE(AdamStep(hp, step, d_p, Upload(g), d_m, d_v, d_vmax, n, stream_).ok());
        cpu::AdamStep(hp, step, absl::MakeSpan(p), g, absl::MakeSpan(m), absl::MakeSpan(v),
                      absl::MakeSpan(v_max));
      }
      ExpectBitwiseEqual(Download(d_p, n), p, "adam param");
      ExpectBitwiseEqual(Download(d_m, n), m, "adam exp_avg");
      ExpectBitwiseEqual(Download(d_v, n), v, "adam exp_avg_sq");
      if (hp.amsgrad) ExpectBitwiseEqual(Download(d_vmax, n), v_max, "adam max_exp_avg_sq");
    }
  }
}

TEST_P(CudaKernelsTest, RefusesUnsupportedArguments) {
  float* d_x = Poisoned<float>(4);
  EXPECT_EQ(Cast(DType::kBFloat16, d_x, DType::kFloat16, d_x, 4, stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Accumulate(DType::kInt64, d_x, d_x, 4, stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Scale(d_x, -1, 1.0f, stream_).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamStep({}, 0, d_x, d_x, d_x, d_x, nullptr, 4, stream_).code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(AlignedAndMisaligned, CudaKernelsTest, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param == 0 ? "Aligned" : "Misaligned"; });

TEST(CudaMemoryTest, ImpossibleAllocationsAreResourceExhausted) {
  absl::StatusOr<int> count = DeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  if (*count == 0) GTEST_SKIP() << "no CUDA device (or no driver) on this machine";
  const size_t huge = size_t{1} << 50;  // 1 PiB
  absl::StatusOr<DeviceMemory> device = DeviceMemory::Allocate(huge, "group 'g' parameters");
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(device.status().message().find("group 'g' parameters"), std::string::npos);
  EXPECT_NE(device.status().message().find("1125899906842624 bytes"), std::string::npos);
  // The device stays usable.
  absl::StatusOr<DeviceMemory> small = DeviceMemory::Allocate(1 << 20, "small");
  EXPECT_TRUE(small.ok()) << small.status();
  absl::StatusOr<PinnedMemory> pinned = PinnedMemory::Allocate(1 << 20, "pinned");
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_NE(pinned->data(), nullptr);
}

}  // namespace
}  // namespace flatshard::kernels::cuda
