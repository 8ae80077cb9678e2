#include "server/optimizer.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flatshard::server {

using kernels::AdamHyperparams;
using kernels::SgdHyperparams;

std::string OptimizerName(const OptimizerConfig& config) {
  if (const auto* adam = std::get_if<AdamHyperparams>(&config)) {
    return adam->decoupled_weight_decay ? "adamw" : "adam";
  }
  return "sgd";
}

bool SameOptimizer(const OptimizerConfig& a, const OptimizerConfig& b) {
  if (a.index() != b.index()) return false;
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

ShardOptimizer::ShardOptimizer(OptimizerConfig config, int64_t shard_numel)
    : config_(std::move(config)) {
  const size_t n = static_cast<size_t>(shard_numel);
  if (const auto* adam = std::get_if<AdamHyperparams>(&config_)) {
    exp_avg_.assign(n, 0.0f);
    exp_avg_sq_.assign(n, 0.0f);
    if (adam->amsgrad) max_exp_avg_sq_.assign(n, 0.0f);
  } else if (std::get<SgdHyperparams>(config_).momentum != 0.0f) {
    exp_avg_.assign(n, 0.0f);
  }
}

void ShardOptimizer::Step(absl::Span<float> params, absl::Span<const float> grad) {
  ++steps_;
  if (const auto* adam = std::get_if<AdamHyperparams>(&config_)) {
    kernels::cpu::AdamStep(*adam, steps_, params, grad, absl::MakeSpan(exp_avg_),
                           absl::MakeSpan(exp_avg_sq_), absl::MakeSpan(max_exp_avg_sq_));
    return;
  }
  const auto& sgd = std::get<SgdHyperparams>(config_);
  if (sgd.momentum != 0.0f && exp_avg_.size() != params.size()) {
    exp_avg_.assign(params.size(), 0.0f);  // momentum turned on by SetConfig
  }
  // torch initializes the momentum buffer on the first step that uses momentum.
  const bool first_momentum_step = !momentum_initialized_;
  kernels::cpu::SgdStep(sgd, first_momentum_step, params, grad, absl::MakeSpan(exp_avg_));
  if (sgd.momentum != 0.0f) momentum_initialized_ = true;
}

absl::Status ShardOptimizer::SetConfig(const OptimizerConfig& config) {
  if (config.index() != config_.index()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer is ", OptimizerName(config_), "; cannot switch to ", OptimizerName(config)));
  }
  if (const auto* adam = std::get_if<AdamHyperparams>(&config)) {
    if (adam->amsgrad && max_exp_avg_sq_.size() != exp_avg_.size()) {
      max_exp_avg_sq_.assign(exp_avg_.size(), 0.0f);
    }
  }
  config_ = config;
  return absl::OkStatus();
}

void ShardOptimizer::Reset() {
  steps_ = 0;
  momentum_initialized_ = false;
  std::fill(exp_avg_.begin(), exp_avg_.end(), 0.0f);
  std::fill(exp_avg_sq_.begin(), exp_avg_sq_.end(), 0.0f);
  std::fill(max_exp_avg_sq_.begin(), max_exp_avg_sq_.end(), 0.0f);
}

std::vector<std::string> ShardOptimizer::state_names() const {
  if (const auto* adam = std::get_if<AdamHyperparams>(&config_)) {
    if (adam->amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    return {"exp_avg", "exp_avg_sq"};
  }
  if (!exp_avg_.empty()) return {"momentum_buffer"};
  return {};
}

absl::Span<const float> ShardOptimizer::state(absl::string_view name) const {
  if (name == "exp_avg" || name == "momentum_buffer") return exp_avg_;
  if (name == "exp_avg_sq") return exp_avg_sq_;
  if (name == "max_exp_avg_sq") return max_exp_avg_sq_;
  return {};
}

absl::Status ShardOptimizer::Restore(
    int64_t steps, bool momentum_initialized,
    std::vector<std::pair<std::string, std::vector<float>>> state) {
  const std::vector<std::string> names = state_names();
  for (const std::string& name : names) {
    const auto it = std::find_if(state.begin(), state.end(), [&](const auto& entry) { return entry.first == name; });
    if (it == state.end() || it->second.size() != this->state(name).size()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' is missing or has the wrong size"));
    }
  }
  for (auto& [name, values] : state) {
    if (name == "exp_avg" || name == "momentum_buffer") exp_avg_ = std::move(values);
    if (name == "exp_avg_sq") exp_avg_sq_ = std::move(values);
    if (name == "max_exp_avg_sq") max_exp_avg_sq_ = std::move(values);
  }
  steps_ = steps;
  momentum_initialized_ = momentum_initialized;
  return absl::OkStatus();
}

int64_t ShardOptimizer::state_bytes() const {
  return static_cast<int64_t>((exp_avg_.size() + exp_avg_sq_.size() + max_exp_avg_sq_.size()) *
                              sizeof(float));
}

}  // namespace flatshard::server
