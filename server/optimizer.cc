#include "server/optimizer.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/huge_pages.h"
#include "core/status_macros.h"

namespace flatshard::server {

using kernels::AdamHyperparams;
using kernels::SgdHyperparams;

bool IsFrozen(const OptimizerConfig& config) { return std::holds_alternative<Frozen>(config); }
bool IsAverage(const OptimizerConfig& config) { return std::holds_alternative<Average>(config); }

std::string OptimizerName(const OptimizerConfig& config) {
  if (const auto* adam = std::get_if<AdamHyperparams>(&config)) {
    return adam->decoupled_weight_decay ? "adamw" : "adam";
  }
  if (IsFrozen(config)) return "frozen";
  return IsAverage(config) ? "average" : "sgd";
}

bool SameOptimizer(const OptimizerConfig& a, const OptimizerConfig& b) {
  if (a.index() != b.index()) return false;
  if (IsFrozen(a) || IsAverage(a)) return true;
  if (const auto* x = std::get_if<SgdHyperparams>(&a)) {
    const auto& y = std::get<SgdHyperparams>(b);
    return x->lr == y.lr && x->momentum == y.momentum && x->dampening == y.dampening &&
           x->weight_decay == y.weight_decay && x->nesterov == y.nesterov;
  }
  const auto& x = std::get<AdamHyperparams>(a);
  const auto& y = std::get<AdamHyperparams>(b);
  return x.lr == y.lr && x.beta1 == y.beta1 && x.beta2 == y.beta2 && x.eps == y.eps &&
         x.weight_decay == y.weight_decay && x.amsgrad == y.amsgrad &&
         x.decoupled_weight_decay == y.decoupled_weight_decay;
}

namespace {

// The shortest decimal text that reads back as the same float (0.9f -> "0.9").
std::string ShortestFloat(float value) {
  for (int digits = 1; digits < 9; ++digits) {
    const std::string text = absl::StrFormat("%.*g", digits, value);
    if (std::strtof(text.c_str(), nullptr) == value) return text;
  }
  return absl::StrFormat("%.9g", value);
}

}  // namespace

std::string OptimizerHyperparamsJson(const OptimizerConfig& config) {
  if (IsFrozen(config) || IsAverage(config)) return "{}";
  if (const auto* sgd = std::get_if<SgdHyperparams>(&config)) {
    return absl::StrCat(R"({"lr":)", ShortestFloat(sgd->lr), R"(,"momentum":)", ShortestFloat(sgd->momentum),
                        R"(,"dampening":)", ShortestFloat(sgd->dampening), R"(,"weight_decay":)",
                        ShortestFloat(sgd->weight_decay), R"(,"nesterov":)", sgd->nesterov ? "true" : "false",
                        "}");
  }
  const auto& adam = std::get<AdamHyperparams>(config);
  return absl::StrCat(R"({"lr":)", ShortestFloat(adam.lr), R"(,"betas":[)", ShortestFloat(adam.beta1), ",",
                      ShortestFloat(adam.beta2), R"(],"eps":)", ShortestFloat(adam.eps), R"(,"weight_decay":)",
                      ShortestFloat(adam.weight_decay), R"(,"amsgrad":)", adam.amsgrad ? "true" : "false", "}");
}

absl::Status ValidateOptimizer(const OptimizerConfig& config) {
  if (IsFrozen(config) || IsAverage(config)) return absl::OkStatus();
  if (const auto* sgd = std::get_if<SgdHyperparams>(&config)) {
    if (!(sgd->lr >= 0)) return absl::InvalidArgumentError(absl::StrCat("sgd.lr: ", sgd->lr, " < 0"));
    if (!(sgd->momentum >= 0)) return absl::InvalidArgumentError("sgd.momentum: must be >= 0");
    if (!(sgd->weight_decay >= 0)) return absl::InvalidArgumentError("sgd.weight_decay: must be >= 0");
    if (sgd->nesterov && (sgd->momentum <= 0 || sgd->dampening != 0)) {
      return absl::InvalidArgumentError("sgd.nesterov: requires momentum > 0 and dampening = 0");
    }
    return absl::OkStatus();
  }
  const auto& adam = std::get<AdamHyperparams>(config);
  if (!(adam.lr >= 0)) return absl::InvalidArgumentError(absl::StrCat("adam.lr: ", adam.lr, " < 0"));
  if (!(adam.beta1 >= 0 && adam.beta1 < 1)) return absl::InvalidArgumentError("adam.beta1: must be in [0, 1)");
  if (!(adam.beta2 >= 0 && adam.beta2 < 1)) return absl::InvalidArgumentError("adam.beta2: must be in [0, 1)");
  if (!(adam.eps > 0)) return absl::InvalidArgumentError("adam.eps: must be > 0");
  if (!(adam.weight_decay >= 0)) return absl::InvalidArgumentError("adam.weight_decay: must be >= 0");
  return absl::OkStatus();
}

absl::StatusOr<ShardOptimizer> ShardOptimizer::Create(OptimizerConfig config, int64_t shard_numel,
                                                     ShardCompute& compute, absl::string_view what) {
  return Create(std::move(config), shard_numel, compute, what,
                [&compute](size_t bytes, absl::string_view buffer) { return compute.AllocateShard(bytes, buffer); });
}

absl::StatusOr<ShardOptimizer> ShardOptimizer::Create(OptimizerConfig config, int64_t shard_numel,
                                                     ShardCompute& compute, absl::string_view what,
                                                     AllocateZeroed allocate) {
  ShardOptimizer optimizer(std::move(config), shard_numel, compute, std::string(what));
  FLATSHARD_RETURN_IF_ERROR(optimizer.AllocateState(allocate));
  return optimizer;
}

absl::Status ShardOptimizer::AllocateState(AllocateZeroed allocate) {
  const size_t bytes = static_cast<size_t>(numel_) * sizeof(float);
  auto ensure = [&](ShardBuffer& buffer, absl::string_view name) -> absl::Status {
    if (buffer.size() == bytes) return absl::OkStatus();
    FLATSHARD_ASSIGN_OR_RETURN(buffer, allocate(bytes, absl::StrCat(what_, " ", name)));
    return absl::OkStatus();
  };
  if (const auto* adam = std::get_if<AdamHyperparams>(&config_)) {
    FLATSHARD_RETURN_IF_ERROR(ensure(exp_avg_, "exp_avg"));
    FLATSHARD_RETURN_IF_ERROR(ensure(exp_avg_sq_, "exp_avg_sq"));
    if (adam->amsgrad) FLATSHARD_RETURN_IF_ERROR(ensure(max_exp_avg_sq_, "max_exp_avg_sq"));
  } else if (const auto* sgd = std::get_if<SgdHyperparams>(&config_); sgd != nullptr && sgd->momentum != 0.0f) {
    FLATSHARD_RETURN_IF_ERROR(ensure(exp_avg_, "momentum_buffer"));
  }
  return absl::OkStatus();
}

absl::Status ShardOptimizer::Step(float* params, const float* grad) {
  if (IsFrozen(config_)) {
    return absl::FailedPreconditionError(absl::StrCat(what_, ": the group is frozen and takes no steps"));
  }
  ++steps_;
  if (IsAverage(config_)) {
    return compute_->CopyBytes(params, grad, static_cast<size_t>(numel_) * sizeof(float));
  }
  if (const auto* adam = std::get_if<AdamHyperparams>(&config_)) {
    return compute_->AdamStep(*adam, steps_, params, grad, exp_avg_.floats(), exp_avg_sq_.floats(),
                              adam->amsgrad ? max_exp_avg_sq_.floats() : nullptr, numel_);
  }
  const auto& sgd = std::get<SgdHyperparams>(config_);
  // torch initializes the momentum buffer on the first step that uses momentum.
  const bool first_momentum_step = !momentum_initialized_;
  FLATSHARD_RETURN_IF_ERROR(compute_->SgdStep(sgd, first_momentum_step, params, grad,
                                              sgd.momentum != 0.0f ? exp_avg_.floats() : nullptr,
                                              numel_));
  if (sgd.momentum != 0.0f) momentum_initialized_ = true;
  return absl::OkStatus();
}

absl::Status ShardOptimizer::CheckConfig(const OptimizerConfig& config) const {
  if (config.index() == config_.index()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("optimizer is ", OptimizerName(config_), "; cannot switch to ", OptimizerName(config)));
}

absl::Status ShardOptimizer::SetConfig(const OptimizerConfig& config) {
  FLATSHARD_RETURN_IF_ERROR(CheckConfig(config));
  const OptimizerConfig previous = config_;
  config_ = config;
  absl::Status allocated =
      AllocateState([this](size_t bytes, absl::string_view what) { return compute_->AllocateShard(bytes, what); });
  if (!allocated.ok()) config_ = previous;
  return allocated;
}

absl::Status ShardOptimizer::Reset() {
  steps_ = 0;
  momentum_initialized_ = false;
  for (ShardBuffer* buffer : {&exp_avg_, &exp_avg_sq_, &max_exp_avg_sq_}) {
    FLATSHARD_RETURN_IF_ERROR(compute_->Zero(buffer->floats(), buffer->numel()));
  }
  return absl::OkStatus();
}

std::vector<std::string> ShardOptimizer::state_names() const {
  if (const auto* adam = std::get_if<AdamHyperparams>(&config_)) {
    if (adam->amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    return {"exp_avg", "exp_avg_sq"};
  }
  if (exp_avg_.size() > 0) return {"momentum_buffer"};
  return {};
}

const ShardBuffer* ShardOptimizer::StateBuffer(absl::string_view name) const {
  const std::vector<std::string> names = state_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) return nullptr;
  if (name == "exp_avg" || name == "momentum_buffer") return &exp_avg_;
  if (name == "exp_avg_sq") return &exp_avg_sq_;
  return &max_exp_avg_sq_;
}

ShardBuffer* ShardOptimizer::StateBuffer(absl::string_view name) {
  return const_cast<ShardBuffer*>(std::as_const(*this).StateBuffer(name));
}

absl::StatusOr<HostFloats> ShardOptimizer::ReadState(absl::string_view name) const {
  HostFloats values;
  ResizeWithHugePages(values, numel_);
  FLATSHARD_RETURN_IF_ERROR(ReadStateSlice(name, 0, numel_, values.data()));
  return values;
}

absl::Status ShardOptimizer::ReadStateSlice(absl::string_view name, int64_t offset, int64_t count,
                                            float* out) const {
  const ShardBuffer* buffer = StateBuffer(name);
  if (buffer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no optimizer state '", name, "' in ", what_));
  }
  if (offset < 0 || count < 0 || offset > buffer->numel() - count) {  // no overflow
    return absl::OutOfRangeError(absl::StrCat(count, " elements from ", offset, " of ",
                                              buffer->numel(), " in ", what_, " ", name));
  }
  return compute_->CopyToHost(buffer->floats() + offset, out, count);
}

absl::Status ShardOptimizer::Restore(int64_t steps, bool momentum_initialized,
                                     std::vector<std::pair<std::string, ShardBuffer>> state) {
  for (const std::string& name : state_names()) {
    const auto it = std::find_if(state.begin(), state.end(), [&](const auto& entry) { return entry.first == name; });
    if (it == state.end() || it->second.numel() != StateBuffer(name)->numel()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' is missing or has the wrong size"));
    }
  }
  for (auto& [name, values] : state) {
    ShardBuffer* buffer = StateBuffer(name);
    if (buffer == nullptr) continue;
    if (compute_->tier() == MemoryTier::kHost) {
      *buffer = std::move(values);
    } else {
      FLATSHARD_RETURN_IF_ERROR(compute_->CopyFromHost(values.floats(), buffer->floats(), buffer->numel()));
    }
  }
  steps_ = steps;
  momentum_initialized_ = momentum_initialized;
  return absl::OkStatus();
}

int64_t ShardOptimizer::state_bytes() const {
  return static_cast<int64_t>(exp_avg_.size() + exp_avg_sq_.size() + max_exp_avg_sq_.size());
}

}  // namespace flatshard::server
