// SnapshotPool: recycles the host-addressable buffers of gather snapshots between
// versions. Pinned allocations (cudaHostAlloc) cost milliseconds, far more than a step,
// so a group takes its snapshot buffers from here and a snapshot's last reader gives
// its buffer back. Keeps at most kMaxFree buffers. Thread-safe; shared (shared_ptr)
// by its group and the snapshots still being read after the group is gone.
//
//   std::shared_ptr<const ShardBuffer> s = pool->Wrap(*pool->Take(bytes, compute, "..."));
#ifndef FLATSHARD_SERVER_SNAPSHOT_POOL_H_
#define FLATSHARD_SERVER_SNAPSHOT_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/shard_buffer.h"
#include "server/shard_compute.h"

namespace flatshard::server {

class SnapshotPool : public std::enable_shared_from_this<SnapshotPool> {
 public:
  static constexpr size_t kMaxFree = 4;

  // A free buffer of exactly `bytes`, or a new one from compute.AllocateStaging.
  [[nodiscard]] absl::StatusOr<ShardBuffer> Take(size_t bytes, ShardCompute& compute,
                                                 absl::string_view what) {
    {
      absl::MutexLock lock(&mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->size() == bytes) {
          ShardBuffer buffer = std::move(*it);
          free_.erase(it);
          return buffer;
        }
      }
    }
    return compute.AllocateStaging(bytes, what);
  }

  // Shares `buffer`; when the last holder lets go it returns here (or is freed if the
  // pool is gone or full).
  std::shared_ptr<const ShardBuffer> Wrap(ShardBuffer buffer) {
    std::weak_ptr<SnapshotPool> pool = weak_from_this();
    return std::shared_ptr<const ShardBuffer>(
        new ShardBuffer(std::move(buffer)), [pool](const ShardBuffer* released) {
          std::unique_ptr<ShardBuffer> owned(const_cast<ShardBuffer*>(released));
          if (std::shared_ptr<SnapshotPool> alive = pool.lock()) alive->Give(std::move(*owned));
        });
  }

  // What the idle buffers hold, for the group's memory in its status.
  int64_t free_bytes() {
    absl::MutexLock lock(&mu_);
    int64_t bytes = 0;
    for (const ShardBuffer& buffer : free_) bytes += static_cast<int64_t>(buffer.size());
    return bytes;
  }

 private:
  void Give(ShardBuffer buffer) {
    absl::MutexLock lock(&mu_);
    if (free_.size() < kMaxFree) free_.push_back(std::move(buffer));
  }

  absl::Mutex mu_;
  std::vector<ShardBuffer> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SNAPSHOT_POOL_H_
