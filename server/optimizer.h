// The optimizer of a group and its state on one server's shard: SGD (momentum buffer),
// Adam / AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad), none (Frozen: the
// group's parameters are never trained, as torch's parameters that no optimizer holds),
// or Average (module buffers: each step's values are the reduced mean the workers sent).
// The state lives in the group's memory tier and steps run that tier's fused kernels
// (ShardCompute).
// Not thread-safe: its Group serializes access. The ShardCompute must outlive it.
//
//   FLATSHARD_ASSIGN_OR_RETURN(ShardOptimizer opt,
//       ShardOptimizer::Create(AdamHyperparams{.lr = 1e-3f}, shard_numel, compute, "group 'mlp'"));
//   FLATSHARD_RETURN_IF_ERROR(opt.Step(params, grad));
#ifndef FLATSHARD_SERVER_OPTIMIZER_H_
#define FLATSHARD_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/huge_pages.h"
#include "kernels/hyperparams.h"
#include "server/shard_buffer.h"
#include "server/shard_compute.h"

namespace flatshard::server {

// A group that takes no gradients and keeps no optimizer state (frozen parameters).
struct Frozen {};
// A group whose step replaces its values by the workers' mean of what they scattered
// (torch's module buffers, which each worker updates in its forward); no state.
struct Average {};

using OptimizerConfig = std::variant<kernels::SgdHyperparams, kernels::AdamHyperparams, Frozen, Average>;

bool IsFrozen(const OptimizerConfig& config);
bool IsAverage(const OptimizerConfig& config);
// "sgd", "adam", "adamw", "frozen" or "average".
std::string OptimizerName(const OptimizerConfig& config);
bool SameOptimizer(const OptimizerConfig& a, const OptimizerConfig& b);
// The hyper-parameters as a JSON object string, e.g. {"lr":0.001,"betas":[0.9,0.999],...}.
std::string OptimizerHyperparamsJson(const OptimizerConfig& config);
// InvalidArgument naming the field for a negative lr, betas outside [0, 1), eps <= 0,
// nesterov without momentum or with dampening (torch's rules).
[[nodiscard]] absl::Status ValidateOptimizer(const OptimizerConfig& config);

// Zero-filled memory of the group's tier for `bytes` (ShardCompute::AllocateShard, or
// pieces of a HostSlab for a host-tier group made in a batch); ResourceExhausted naming
// `what`.
using AllocateZeroed = absl::FunctionRef<absl::StatusOr<ShardBuffer>(size_t bytes, absl::string_view what)>;

class ShardOptimizer {
 public:
  // Allocates the state (zeroed) in `compute`'s tier, with `allocate` when given (its
  // buffers must be of that tier); ResourceExhausted naming `what`. State allocated later
  // (SetConfig) comes from `compute`.
  [[nodiscard]] static absl::StatusOr<ShardOptimizer> Create(OptimizerConfig config, int64_t shard_numel,
                                                             ShardCompute& compute, absl::string_view what);
  [[nodiscard]] static absl::StatusOr<ShardOptimizer> Create(OptimizerConfig config, int64_t shard_numel,
                                                             ShardCompute& compute, absl::string_view what,
                                                             AllocateZeroed allocate);

  // Applies one step to `params` with the reduced gradient `grad` (both shard_numel,
  // shard memory); Average copies `grad` (the mean) into `params`. Enqueued on the tier;
  // the caller synchronizes. FailedPrecondition when frozen.
  [[nodiscard]] absl::Status Step(float* params, const float* grad);
  // Replaces the hyper-parameters, allocating state that momentum or amsgrad now needs;
  // FailedPrecondition (CheckConfig) if the kind (SGD vs Adam) differs.
  [[nodiscard]] absl::Status SetConfig(const OptimizerConfig& config);
  // What SetConfig would refuse before it allocates anything: another kind.
  [[nodiscard]] absl::Status CheckConfig(const OptimizerConfig& config) const;
  // Forgets all state (after re-initialization of the parameters).
  [[nodiscard]] absl::Status Reset();

  const OptimizerConfig& config() const { return config_; }
  int64_t steps() const { return steps_; }
  int64_t state_bytes() const;

  // The state this optimizer keeps, by torch's names: SGD with momentum
  // {"momentum_buffer"}; Adam/AdamW {"exp_avg", "exp_avg_sq"} (+ "max_exp_avg_sq" with
  // amsgrad); plain SGD, Frozen and Average none. Each buffer has shard_numel elements.
  std::vector<std::string> state_names() const;
  // Copies state `name` to the host. InvalidArgument for a name it does not keep.
  [[nodiscard]] absl::StatusOr<HostFloats> ReadState(absl::string_view name) const;
  // Copies `count` elements of state `name` from element `offset` into `out`.
  [[nodiscard]] absl::Status ReadStateSlice(absl::string_view name, int64_t offset, int64_t count,
                                            float* out) const;
  // Restores steps and state (checkpoint load; host buffers from AllocateHostUnwritten,
  // adopted on the host tier, copied on the others). InvalidArgument naming the buffer if
  // one is missing or has the wrong size; nothing changes then.
  [[nodiscard]] absl::Status Restore(int64_t steps, bool momentum_initialized,
                                     std::vector<std::pair<std::string, ShardBuffer>> state);
  bool momentum_initialized() const { return momentum_initialized_; }

 private:
  ShardOptimizer(OptimizerConfig config, int64_t shard_numel, ShardCompute& compute, std::string what)
      : config_(std::move(config)), numel_(shard_numel), compute_(&compute), what_(std::move(what)) {}
  // Allocates the buffers config_ needs and does not have yet, with `allocate`.
  absl::Status AllocateState(AllocateZeroed allocate);
  ShardBuffer* StateBuffer(absl::string_view name);
  const ShardBuffer* StateBuffer(absl::string_view name) const;

  OptimizerConfig config_;
  int64_t numel_;
  ShardCompute* compute_;
  std::string what_;
  int64_t steps_ = 0;
  bool momentum_initialized_ = false;  // SGD: the buffer holds a value
  ShardBuffer exp_avg_;                // Adam m / SGD momentum buffer
  ShardBuffer exp_avg_sq_;             // Adam v
  ShardBuffer max_exp_avg_sq_;         // amsgrad only
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_OPTIMIZER_H_
