// Internal to the client: the gradient steps one Client has sent, per group, so that a
// save or export it makes right after a training step cuts after that step (DESIGN.md
// "Checkpoints"). The servers apply a step once every worker's gradient is in, so a
// worker that has sent step k may still find its groups at k, some of them already at
// k + 1: the current versions alone would cut inside the step. A client that has sent
// as many steps of every group it trains (it is between steps, not inside one) instead
// has the cut wait for each group to reach its latest step + 1, where a server holds
// its gradient for that step (a checkpoint load drops them: ChooseCut checks); the
// other workers send their gradients without waiting for this one, so those versions
// come. Inside a step (or for a client that sends no gradients) nothing is waited for: a
// clipped job's group cannot step before the rest of this client's gradients arrive.
// Thread-safe.
//
//   SentSteps sent(/*worker_rank=*/1);
//   sent.Register("mlp");                        // on RegisterGroup, unless frozen
//   sent.Record("mlp", 7);                       // on every Scatter
//   std::map<std::string, int64_t> after = sent.AtBoundary();  // {"mlp": 7}
//   bool inside = sent.InsideStep();             // false
#ifndef FLATSHARD_CLIENT_SENT_STEPS_H_
#define FLATSHARD_CLIENT_SENT_STEPS_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/synchronization/mutex.h"

namespace flatshard::client_internal {

class SentSteps {
 public:
  explicit SentSteps(int worker_rank = 0) : worker_rank_(worker_rank) {}

  // This client's rank in its job.
  int worker_rank() const { return worker_rank_; }

  // This client trains `group`: until it has sent a step of it, it is inside its first
  // step if it has sent one of another group.
  void Register(const std::string& group) {
    absl::MutexLock lock(&mu_);
    sent_.try_emplace(group);
  }

  // A gradient of `group` for `step` is being sent. Sending the latest step again (a
  // retry) counts once; any other step (the next, or an earlier one after a load moved
  // the versions back) is a new one.
  void Record(const std::string& group, int64_t step) {
    absl::MutexLock lock(&mu_);
    Sent& sent = sent_[group];
    if (sent.steps > 0 && sent.latest == step) return;
    sent.latest = step;
    ++sent.steps;
  }

  // The versions changed under every group (a checkpoint load): the steps sent so far no
  // longer say where the groups go next.
  void Forget() {
    absl::MutexLock lock(&mu_);
    for (auto& [group, sent] : sent_) sent = Sent();
  }

  // Whether this client has sent a step of some group it trains and not yet as many of
  // every other (it is inside a step).
  bool InsideStep() const {
    absl::MutexLock lock(&mu_);
    bool sent_any = false;
    bool uneven = false;
    for (const auto& [group, sent] : sent_) {
      sent_any |= sent.steps > 0;
      uneven |= sent.steps != sent_.begin()->second.steps;
    }
    return sent_any && uneven;
  }

  // Group -> the latest step sent, if this client has sent as many steps (at least one)
  // of each group it trains or sent any (it is between steps); empty otherwise.
  std::map<std::string, int64_t> AtBoundary() const {
    absl::MutexLock lock(&mu_);
    std::map<std::string, int64_t> latest;
    for (const auto& [group, sent] : sent_) {
      if (sent.steps == 0 || sent.steps != sent_.begin()->second.steps) return {};
      latest[group] = sent.latest;
    }
    return latest;
  }

 private:
  struct Sent {
    int64_t latest = 0;  // the step of the gradient sent last
    int64_t steps = 0;   // how many steps were sent since registration or Forget
  };

  const int worker_rank_;
  mutable absl::Mutex mu_;
  std::map<std::string, Sent> sent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_SENT_STEPS_H_
