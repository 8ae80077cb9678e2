// The optimizer of a group and its state on one server's shard: SGD (momentum buffer),
// Adam / AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad). Steps run the fused
// CPU kernels. Not thread-safe: its Group serializes access.
//
//   ShardOptimizer opt(AdamHyperparams{.lr = 1e-3f}, shard_numel);
//   opt.Step(absl::MakeSpan(params), grad);
#ifndef FLATSHARD_SERVER_OPTIMIZER_H_
#define FLATSHARD_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/cpu/optimizer.h"

namespace flatshard::server {

using OptimizerConfig = std::variant<kernels::SgdHyperparams, kernels::AdamHyperparams>;

// "sgd", "adam" or "adamw".
std::string OptimizerName(const OptimizerConfig& config);
bool SameOptimizer(const OptimizerConfig& a, const OptimizerConfig& b);
// The hyper-parameters as a JSON object string, e.g. {"lr":0.001,"betas":[0.9,0.999],...}.
std::string OptimizerHyperparamsJson(const OptimizerConfig& config);
// InvalidArgument naming the field for a negative lr, betas outside [0, 1), eps <= 0,
// nesterov without momentum or with dampening (torch's rules).
[[nodiscard]] absl::Status ValidateOptimizer(const OptimizerConfig& config);

class ShardOptimizer {
 public:
  ShardOptimizer(OptimizerConfig config, int64_t shard_numel);

  // Applies one step to `params` with the reduced gradient `grad` (both shard_numel).
  void Step(absl::Span<float> params, absl::Span<const float> grad);
  // Replaces the hyper-parameters; FailedPrecondition if the kind (SGD vs Adam) differs.
  [[nodiscard]] absl::Status SetConfig(const OptimizerConfig& config);
  // Forgets all state (after re-initialization of the parameters).
  void Reset();

  const OptimizerConfig& config() const { return config_; }
  int64_t steps() const { return steps_; }
  int64_t state_bytes() const;

  // The state this optimizer keeps, by torch's names: SGD with momentum
  // {"momentum_buffer"}; Adam/AdamW {"exp_avg", "exp_avg_sq"} (+ "max_exp_avg_sq" with
  // amsgrad); plain SGD none. Each buffer has shard_numel elements.
  std::vector<std::string> state_names() const;
  absl::Span<const float> state(absl::string_view name) const;
  // Restores steps and state (checkpoint load). InvalidArgument naming the buffer if one
  // is missing or has the wrong size; nothing changes then.
  [[nodiscard]] absl::Status Restore(int64_t steps, bool momentum_initialized,
                                     std::vector<std::pair<std::string, std::vector<float>>> state);
  bool momentum_initialized() const { return momentum_initialized_; }

 private:
  OptimizerConfig config_;
  int64_t steps_ = 0;
  bool momentum_initialized_ = false;  // SGD: the buffer holds a value
  std::vector<float> exp_avg_;         // Adam m / SGD momentum buffer
  std::vector<float> exp_avg_sq_;      // Adam v
  std::vector<float> max_exp_avg_sq_;  // amsgrad only
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_OPTIMIZER_H_
