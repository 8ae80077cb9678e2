// Internal to the client: what the servers answered this client's latest scatter of each
// group, so that a wait for the version that step makes can be answered without asking
// them again (Client::WaitVersions; one control-plane round trip per training step saved).
// A server answers a gradient once it has taken it, with its group's version then
// (transport/data_protocol.h): step + 1 when this gradient completed the step and the
// server applied it (the only worker's, or the last one's), step while it waits for
// others. So when every server answered a send for step s with s + 1, every one of them
// had reached s + 1. Only that exact answer counts: a lower one says nothing yet, a higher
// one means a checkpoint load moved the group, which the servers themselves then report.
// A later load may move the group back; the caller's next gather sees that, as it does
// when the load comes just after the servers answered a wait. Thread-safe.
//
//   ScatterAnswers answers;
//   const uint64_t send = answers.Begin("mlp", 7);      // a scatter of step 7 goes out
//   answers.Answered("mlp", send, 8);                   // every server took it; lowest version 8
//   bool stepped = answers.Reached({"mlp"}, 8);         // true
#ifndef FLATSHARD_CLIENT_SCATTER_ANSWERS_H_
#define FLATSHARD_CLIENT_SCATTER_ANSWERS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::client_internal {

class ScatterAnswers {
 public:
  // A scatter of `group` for `step` is being sent: what was known of the group's earlier
  // sends no longer counts. Returns the send's number, for Answered.
  uint64_t Begin(const std::string& group, int64_t step) {
    absl::MutexLock lock(&mu_);
    Latest& latest = latest_[group];
    latest = Latest{++sends_, step, std::nullopt};
    return latest.send;
  }

  // Every server took send `send` of `group`; `lowest` is the lowest version any of them
  // answered. Ignored when another send of the group began since, or Forget came between.
  void Answered(const std::string& group, uint64_t send, int64_t lowest) {
    absl::MutexLock lock(&mu_);
    auto it = latest_.find(group);
    if (it != latest_.end() && it->second.send == send) it->second.lowest = lowest;
  }

  // Whether each of `groups`' latest sends was for step version - 1 and every server
  // answered it with exactly `version`.
  bool Reached(const std::vector<std::string>& groups, int64_t version) const {
    absl::MutexLock lock(&mu_);
    for (const std::string& group : groups) {
      auto it = latest_.find(group);
      if (it == latest_.end() || it->second.step != version - 1 || it->second.lowest != version) return false;
    }
    return true;
  }

  // The versions changed under every group (this client loaded a checkpoint or deleted
  // the job): no answer counts any more.
  void Forget() {
    absl::MutexLock lock(&mu_);
    latest_.clear();
  }

 private:
  struct Latest {
    uint64_t send = 0;
    int64_t step = 0;
    std::optional<int64_t> lowest;  // once every server answered OK
  };

  mutable absl::Mutex mu_;
  uint64_t sends_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Latest> latest_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_SCATTER_ANSWERS_H_
