// CheckpointProgress: the bytes done and to do of the checkpoint saves and loads running
// on this server, for GetStatus, from which `flatshard save|load` draw a progress bar.
// An operation is listed from Start until its ProgressCounter is released; its writers
// and readers add to the counter as they go: tensor bytes only, so that done never
// passes total. Thread-safe.
//
//   std::shared_ptr<ProgressCounter> counter = progress.Start("step-100", "save");
//   counter->total += bytes_to_write;
//   counter->done += written;  // from any thread
//   for (const ProgressRow& row : progress.Rows()) ...
#ifndef FLATSHARD_SERVER_CHECKPOINT_PROGRESS_H_
#define FLATSHARD_SERVER_CHECKPOINT_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace flatshard::server {

struct ProgressCounter {
  std::atomic<uint64_t> done{0};
  std::atomic<uint64_t> total{0};
};

struct ProgressRow {
  std::string name;       // the checkpoint
  std::string operation;  // "save", "load" or "import"
  uint64_t done = 0;
  uint64_t total = 0;
};

class CheckpointProgress {
 public:
  // Lists `operation` on checkpoint `name` while the returned counter is held.
  std::shared_ptr<ProgressCounter> Start(std::string name, std::string operation);
  // The operations still running.
  std::vector<ProgressRow> Rows();

 private:
  struct Entry {
    std::string name, operation;
    std::weak_ptr<ProgressCounter> counter;
  };
  absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_PROGRESS_H_
