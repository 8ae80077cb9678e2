// ComputePool: the threads a server's CPU-tier kernels (host and pinned memory) run on.
// A kernel call over a large shard is cut into chunks that the pool's threads and the
// calling thread run at once; small calls stay on the caller. All groups of a server
// share one pool, so however many groups step together the server never runs more than
// `threads()` kernel threads. Built on oneTBB's task_arena (its work stealing balances
// the chunks of concurrent calls).
//
// Chunk boundaries are multiples of kAlignElements, so no two threads write the same
// cache line of a float32 buffer. Element-wise kernels give the same bits however they
// are chunked; reductions whose result depends on the order must not use the pool.
//
// Thread-safe: ParallelFor may be called from any number of threads at once. The pool
// must outlive its calls (CpuShardCompute holds it by shared_ptr).
//
//   auto pool = std::make_shared<ComputePool>(0);  // one thread per hardware thread
//   pool->ParallelFor(n, [&](int64_t begin, int64_t end) { Kernel(x + begin, end - begin); });
#ifndef FLATSHARD_SERVER_COMPUTE_POOL_H_
#define FLATSHARD_SERVER_COMPUTE_POOL_H_

#include <cstdint>
#include <memory>

#include "absl/functional/function_ref.h"

namespace flatshard::server {

class ComputePool {
 public:
  // Chunk starts are multiples of this many elements (64 bytes of float32).
  static constexpr int64_t kAlignElements = 16;
  // Calls over fewer than twice this many elements run on the calling thread: below it,
  // waking threads costs more than they save.
  static constexpr int64_t kMinChunkElements = int64_t{1} << 16;

  // `threads` <= 0: one per hardware thread. 1: every call runs on its caller.
  explicit ComputePool(int threads);
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  int threads() const { return threads_; }

  // Calls body(begin, end) on disjoint ranges that together cover [0, n) exactly once,
  // each at least kMinChunkElements long (but for the last), and returns when all have
  // returned. `body` must be safe to run on several threads at once.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t begin, int64_t end)> body) const;

 private:
  struct Arena;  // the oneTBB arena, kept out of this header
  const int threads_;
  std::unique_ptr<Arena> arena_;  // null when threads_ == 1
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_COMPUTE_POOL_H_
