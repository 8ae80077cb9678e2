#include "server/compute_pool.h"

#include <algorithm>
#include <thread>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

namespace flatshard::server {

struct ComputePool::Arena {
  explicit Arena(int threads) : arena(threads) {}
  tbb::task_arena arena;
};

namespace {

int ResolveThreads(int threads) {
  if (threads > 0) return threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

ComputePool::ComputePool(int threads) : threads_(ResolveThreads(threads)) {
  if (threads_ > 1) arena_ = std::make_unique<Arena>(threads_);
}

ComputePool::~ComputePool() = default;

void ComputePool::ParallelFor(int64_t n,
                              absl::FunctionRef<void(int64_t begin, int64_t end)> body) const {
  if (n <= 0) return;
  if (arena_ == nullptr || n < 2 * kMinChunkElements) {
    body(0, n);
    return;
  }
  // Blocks of kAlignElements; a chunk is a range of whole blocks (the last block short).
  // oneTBB splits a range in halves while it is longer than the grain, so with a grain
  // of twice the minimum no chunk is shorter than the minimum.
  const int64_t blocks = (n + kAlignElements - 1) / kAlignElements;
  const tbb::blocked_range<int64_t> range(0, blocks, 2 * kMinChunkElements / kAlignElements);
  arena_->arena.execute([&] {
    tbb::parallel_for(range, [&](const tbb::blocked_range<int64_t>& chunk) {
      body(chunk.begin() * kAlignElements, std::min(n, chunk.end() * kAlignElements));
    });
  });
}

}  // namespace flatshard::server
