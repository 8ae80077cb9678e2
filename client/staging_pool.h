// Internal to the client: host buffers for staging device transfers over TCP, and a pool
// that keeps them between transfers. A device buffer's bytes go to (or come from) a TCP
// server through host memory; pinned memory makes those copies DMA at the link's speed,
// and reusing it avoids pinning (slow) and page faults on every call. Buffers are not
// zeroed. StagingPool is thread-safe.
//
//   StagingPool pool(&AllocateStagingHost, /*max_idle=*/4);
//   FLATSHARD_ASSIGN_OR_RETURN(StagingBuffer buffer, pool.Take(bytes));
//   ... copy, send ...
//   pool.Give(std::move(buffer));
#ifndef FLATSHARD_CLIENT_STAGING_POOL_H_
#define FLATSHARD_CLIENT_STAGING_POOL_H_

#include <algorithm>
#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/owned_buffer.h"

namespace flatshard::client_internal {

// A host staging buffer (core/owned_buffer.h): pinned or heap memory with its free.
using StagingBuffer = OwnedBuffer;

class StagingPool {
 public:
  // Makes a buffer of exactly the bytes asked, or says why it cannot.
  using Allocate = std::function<absl::StatusOr<StagingBuffer>(size_t bytes)>;

  // Keeps at most `max_idle` (at least 1) buffers between transfers.
  StagingPool(Allocate allocate, int max_idle)
      : allocate_(std::move(allocate)), max_idle_(std::max(1, max_idle)) {}

  // The smallest idle buffer of at least `bytes`, else a new one of `bytes`.
  [[nodiscard]] absl::StatusOr<StagingBuffer> Take(size_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      auto best = idle_.end();
      for (auto it = idle_.begin(); it != idle_.end(); ++it) {
        if (it->size() >= bytes && (best == idle_.end() || it->size() < best->size())) best = it;
      }
      if (best != idle_.end()) {
        StagingBuffer buffer = std::move(*best);
        idle_.erase(best);
        return buffer;
      }
    }
    return allocate_(bytes);  // without the lock: pinning can take milliseconds
  }

  // Returns a buffer for reuse. Beyond max_idle idle buffers the smallest is freed, so
  // the pool keeps the sizes transfers need.
  void Give(StagingBuffer buffer) {
    StagingBuffer dropped;
    absl::MutexLock lock(&mu_);
    idle_.push_back(std::move(buffer));
    if (static_cast<int>(idle_.size()) <= max_idle_) return;
    auto smallest = std::min_element(
        idle_.begin(), idle_.end(),
        [](const StagingBuffer& a, const StagingBuffer& b) { return a.size() < b.size(); });
    dropped = std::move(*smallest);  // freed after the lock is released
    idle_.erase(smallest);
  }

  int idle() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(idle_.size());
  }

 private:
  const Allocate allocate_;
  const int max_idle_;
  absl::Mutex mu_;
  std::vector<StagingBuffer> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_STAGING_POOL_H_
