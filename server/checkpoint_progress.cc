#include "server/checkpoint_progress.h"

#include <algorithm>

namespace flatshard::server {

std::shared_ptr<ProgressCounter> CheckpointProgress::Start(std::string name, std::string operation) {
  auto counter = std::make_shared<ProgressCounter>();
  absl::MutexLock lock(&mu_);
  entries_.push_back({std::move(name), std::move(operation), counter});
  return counter;
}

std::vector<ProgressRow> CheckpointProgress::Rows() {
  absl::MutexLock lock(&mu_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.counter.expired(); }),
                 entries_.end());
  std::vector<ProgressRow> rows;
  for (const Entry& entry : entries_) {
    if (const std::shared_ptr<ProgressCounter> counter = entry.counter.lock()) {
      rows.push_back({entry.name, entry.operation, counter->done.load(), counter->total.load()});
    }
  }
  return rows;
}

}  // namespace flatshard::server
