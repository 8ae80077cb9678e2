// The CPU tiers' kernel threads: chunking, concurrency, and that pooled kernels give the
// same bits as the same kernels on one thread.
#include "server/compute_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <limits>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "server/group.h"
#include "server/shard_compute.h"

namespace flatshard::server {
namespace {

constexpr int64_t kMin = ComputePool::kMinChunkElements;

std::vector<std::pair<int64_t, int64_t>> Chunks(const ComputePool& pool, int64_t n) {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  pool.ParallelFor(n, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mu);
    chunks.emplace_back(begin, end);
  });
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

TEST(ComputePoolTest, ChunksTileTheRangeOnceAlignedAndNoShorterThanTheMinimum) {
  const ComputePool pool(4);
  EXPECT_EQ(pool.threads(), 4);
  for (const int64_t n : {int64_t{0}, int64_t{1}, 2 * kMin - 1, 2 * kMin, 5 * kMin + 7, int64_t{3'000'017}}) {
    SCOPED_TRACE(n);
    const auto chunks = Chunks(pool, n);
    if (n == 0) {
      EXPECT_TRUE(chunks.empty());
      continue;
    }
    int64_t next = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const auto [begin, end] = chunks[i];
      EXPECT_EQ(begin, next);
      EXPECT_EQ(begin % ComputePool::kAlignElements, 0);
      EXPECT_GT(end, begin);
      if (i + 1 < chunks.size()) {
        EXPECT_GE(end - begin, kMin);
      }
      next = end;
    }
    EXPECT_EQ(next, n);
    if (n < 2 * kMin) {
      EXPECT_EQ(chunks.size(), 1u) << "small calls stay whole";
    }
  }
  EXPECT_GT(Chunks(pool, 3'000'017).size(), 1u) << "a large call is split";
}

TEST(ComputePoolTest, OneThreadRunsTheWholeRangeOnTheCaller) {
  const ComputePool pool(1);
  const std::thread::id caller = std::this_thread::get_id();
  int calls = 0;
  pool.ParallelFor(10 * kMin, [&](int64_t begin, int64_t end) {
    ++calls;
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 10 * kMin);
    EXPECT_EQ(std::this_thread::get_id(), caller);
  });
  EXPECT_EQ(calls, 1);
}

TEST(ComputePoolTest, ChunksRunOnSeveralThreadsAtOnce) {
  // Every chunk waits (up to 10 s) until two chunks are running at the same moment:
  // with one thread that never happens.
  const ComputePool pool(2);
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  bool met = false;
  std::set<std::thread::id> threads;
  pool.ParallelFor(64 * kMin, [&](int64_t, int64_t) {
    std::unique_lock<std::mutex> lock(mu);
    threads.insert(std::this_thread::get_id());
    if (++running >= 2) met = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(10), [&] { return met; });
    --running;
  });
  EXPECT_TRUE(met);
  EXPECT_GE(threads.size(), 2u);
}

TEST(ComputePoolTest, ConcurrentCallersEachGetTheirWholeRange) {
  const ComputePool pool(3);
  const int64_t n = 7 * kMin + 5;
  std::vector<std::vector<int>> counts(4, std::vector<int>(n, 0));
  std::vector<std::thread> callers;
  for (auto& count : counts) {
    callers.emplace_back([&pool, &count, n] {
      for (int round = 0; round < 10; ++round) {
        pool.ParallelFor(n, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) ++count[i];
        });
      }
    });
  }
  for (auto& caller : callers) caller.join();
  for (const auto& count : counts) {
    EXPECT_TRUE(std::all_of(count.begin(), count.end(), [](int c) { return c == 10; }));
  }
}

// Pooled CPU kernels against the same kernels on one thread: element-wise math, so the
// bits must not depend on the chunking. The size is odd and spans many chunks.
class PooledKernelsTest : public ::testing::Test {
 protected:
  static constexpr int64_t n = 9 * kMin + 13;

  PooledKernelsTest() : pool_(std::make_shared<ComputePool>(4)) {
    pooled_ = *MakeShardCompute(MemoryTier::kHost, pool_);
    serial_ = *MakeShardCompute(MemoryTier::kHost, nullptr);
  }

  static std::vector<float> Random(uint32_t seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> values(n);
    for (float& v : values) v = normal(rng);
    return values;
  }
  static std::vector<uint16_t> Half(const std::vector<float>& values, DType dtype) {
    std::vector<uint16_t> bits(values.size());
    EXPECT_TRUE(kernels::cpu::Cast(DType::kFloat32, values.data(), dtype, bits.data(), n).ok());
    return bits;
  }
  // Runs `kernel` on both computes, each on its own copy of `buffers`, and expects the
  // copies to end up bitwise equal.
  template <typename Buffers, typename Kernel>
  void ExpectSameBits(const Buffers& buffers, Kernel kernel) {
    Buffers pooled = buffers, serial = buffers;
    ASSERT_TRUE(kernel(*pooled_, pooled).ok());
    ASSERT_TRUE(kernel(*serial_, serial).ok());
    EXPECT_TRUE(pooled == serial);
    EXPECT_FALSE(pooled == buffers) << "the kernel wrote nothing";
  }

  std::shared_ptr<ComputePool> pool_;
  std::unique_ptr<ShardCompute> pooled_, serial_;
};

TEST_F(PooledKernelsTest, CastsMatchOneThread) {
  // The outputs are compared as integers, so NaN payloads count too.
  std::vector<float> values = Random(1, 1e4f);
  values[3] = std::numeric_limits<float>::quiet_NaN();
  values[n - 1] = std::numeric_limits<float>::infinity();
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    ExpectSameBits(std::vector<uint16_t>(n, 0xFFFF), [&](ShardCompute& c, std::vector<uint16_t>& dst) {
      return c.Cast(DType::kFloat32, values.data(), dtype, dst.data(), n);
    });
    const std::vector<uint16_t> half = Half(values, dtype);
    ExpectSameBits(std::vector<uint32_t>(n, 0xFFFFFFFF), [&](ShardCompute& c, std::vector<uint32_t>& dst) {
      return c.Cast(dtype, half.data(), DType::kFloat32, dst.data(), n);
    });
  }
}

TEST_F(PooledKernelsTest, ReductionOfMixedDtypesMatchesOneThread) {
  const std::vector<float> a = Random(2), b = Random(3), c = Random(4);
  const std::vector<uint16_t> b16 = Half(b, DType::kBFloat16), c16 = Half(c, DType::kFloat16);
  const kernels::Contribution contributions[] = {
      {DType::kFloat32, a.data()}, {DType::kBFloat16, b16.data()}, {DType::kFloat16, c16.data()}};
  ExpectSameBits(std::vector<float>(n, -1.0f), [&](ShardCompute& compute, std::vector<float>& dst) {
    return compute.Reduce(contributions, dst.data(), n, 1.0f / 3.0f);
  });
  ExpectSameBits(Random(5), [&](ShardCompute& compute, std::vector<float>& x) {
    return compute.Scale(x.data(), n, 0.37f);
  });
}

TEST_F(PooledKernelsTest, OptimizerStepsMatchOneThread) {
  const std::vector<float> grad = Random(6, 0.1f);
  using Sgd = std::pair<std::vector<float>, std::vector<float>>;  // param, momentum
  ExpectSameBits(Sgd{Random(7), Random(8, 0.01f)}, [&](ShardCompute& c, Sgd& s) {
    return c.SgdStep({.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true}, false,
                     s.first.data(), grad.data(), s.second.data(), n);
  });
  using Adam = std::array<std::vector<float>, 4>;  // param, exp_avg, exp_avg_sq, max
  const std::vector<float> moments = Random(9, 0.01f);
  std::vector<float> squares(n);
  std::transform(moments.begin(), moments.end(), squares.begin(), [](float m) { return m * m; });
  ExpectSameBits(Adam{Random(10), moments, squares, squares}, [&](ShardCompute& c, Adam& s) {
    return c.AdamStep({.lr = 1e-3f, .weight_decay = 0.01f, .amsgrad = true, .decoupled_weight_decay = true},
                      7, s[0].data(), grad.data(), s[1].data(), s[2].data(), s[3].data(), n);
  });
}

TEST_F(PooledKernelsTest, CopiesAndZeroMatchOneThread) {
  const std::vector<float> source = Random(11);
  ExpectSameBits(std::vector<float>(n, 0.0f), [&](ShardCompute& c, std::vector<float>& dst) {
    return c.CopyFromHost(source.data(), dst.data(), n);
  });
  ExpectSameBits(std::vector<float>(n, 0.0f), [&](ShardCompute& c, std::vector<float>& dst) {
    return c.CopyToHost(source.data(), dst.data(), n);
  });
  ExpectSameBits(source, [&](ShardCompute& c, std::vector<float>& x) { return c.Zero(x.data(), n); });
}

TEST_F(PooledKernelsTest, BadDtypesAreRefusedBeforeAnythingIsWritten) {
  std::vector<float> dst(n, -7.0f);
  const std::vector<float> src = Random(12);
  const absl::Status cast = pooled_->Cast(DType::kFloat32, src.data(), DType::kInt64, dst.data(), n);
  EXPECT_EQ(cast.code(), absl::StatusCode::kInvalidArgument) << cast;
  const kernels::Contribution bad[] = {{DType::kFloat32, src.data()}, {DType::kInt32, src.data()}};
  const absl::Status reduce = pooled_->Reduce(bad, dst.data(), n, 1.0f);
  EXPECT_EQ(reduce.code(), absl::StatusCode::kInvalidArgument) << reduce;
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](float v) { return v == -7.0f; }));
}

// A group on the pool steps to the same bits as one without: two workers in bf16 and
// float32, AdamW, several steps.
TEST(PooledGroupTest, StepsMatchAGroupWithoutThePool) {
  auto layout = *FlatLayout::Create({{"w", {3 * kMin + 5}, DType::kFloat32}, {"b", {kMin + 1}, DType::kFloat32}},
                                    0, /*num_shards=*/1);
  const JobSettings job{.num_workers = 2};
  const OptimizerConfig adamw = kernels::AdamHyperparams{.lr = 1e-2f, .weight_decay = 0.1f,
                                                         .decoupled_weight_decay = true};
  auto pooled = *Group::Create("job", "g", layout, Placement{}, job, adamw, MemoryTier::kHost,
                               std::make_shared<ComputePool>(3));
  auto serial = *Group::Create("job", "g", layout, Placement{}, job, adamw, MemoryTier::kHost, nullptr);
  const int64_t numel = layout.shard_numel();
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  for (Group* group : {pooled.get(), serial.get()}) ASSERT_TRUE(group->InitFromSeed(5).ok());
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<float> grads[2] = {std::vector<float>(numel), std::vector<float>(numel)};
    for (auto& grad : grads) std::generate(grad.begin(), grad.end(), [&] { return normal(rng); });
    for (Group* group : {pooled.get(), serial.get()}) {
      for (int worker = 0; worker < 2; ++worker) {
        const DType dtype = worker == 0 ? DType::kBFloat16 : DType::kFloat32;
        absl::StatusOr<ReceiveSlot> slot = group->BeginScatter(step, worker, dtype);
        ASSERT_TRUE(slot.ok()) << slot.status();
        ASSERT_TRUE(kernels::cpu::Cast(DType::kFloat32, grads[worker].data(), dtype, slot->buffer.data(), numel).ok());
        ASSERT_TRUE(group->CommitScatter(*slot).ok());
      }
      ASSERT_EQ(group->version(), step + 1);
    }
  }
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    auto a = pooled->Gather(3, dtype, absl::InfiniteFuture());
    auto b = serial->Gather(3, dtype, absl::InfiniteFuture());
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->bytes->size(), b->bytes->size());
    EXPECT_EQ(std::memcmp(a->bytes->data(), b->bytes->data(), a->bytes->size()), 0) << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace flatshard::server
