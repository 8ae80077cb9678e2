#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/multiversion.h"

#include <cmath>

namespace flatshard::kernels::cpu {

FLATSHARD_MULTIVERSION void SgdStep(const SgdHyperparams& hp, bool first_step, absl::Span<float> param,
             absl::Span<const float> grad, absl::Span<float> momentum_buffer) {
  float* p = param.data();
  const float* g = grad.data();
  float* buf = momentum_buffer.data();
  const size_t n = param.size();
  const float wd = hp.weight_decay;
  const float lr = hp.lr;
  if (hp.momentum == 0.0f) {
    for (size_t i = 0; i < n; ++i) {
      const float d_p = wd != 0.0f ? g[i] + wd * p[i] : g[i];
      p[i] = p[i] + (-lr) * d_p;
    }
    return;
  }
  const float momentum = hp.momentum;
  const float one_minus_dampening = 1.0f - hp.dampening;
  for (size_t i = 0; i < n; ++i) {
    const float d_p = wd != 0.0f ? g[i] + wd * p[i] : g[i];
    const float b = first_step ? d_p : buf[i] * momentum + one_minus_dampening * d_p;
    buf[i] = b;
    const float update = hp.nesterov ? d_p + momentum * b : b;
    p[i] = p[i] + (-lr) * update;
  }
}

FLATSHARD_MULTIVERSION void AdamStep(const AdamHyperparams& hp, int64_t step, absl::Span<float> param,
              absl::Span<const float> grad, absl::Span<float> exp_avg,
              absl::Span<float> exp_avg_sq, absl::Span<float> max_exp_avg_sq) {
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(hp.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(hp.beta2), step);
  const float step_size = static_cast<float>(hp.lr / bias_correction1);
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float beta1 = hp.beta1;
  const float beta2 = hp.beta2;
  const float one_minus_beta1 = 1.0f - beta1;
  const float one_minus_beta2 = 1.0f - beta2;
  const float eps = hp.eps;
  const float wd = hp.weight_decay;
  const float decay_factor = 1.0f - hp.lr * wd;  // AdamW: param.mul_(1 - lr * wd)
  const bool decoupled = hp.decoupled_weight_decay;

  float* p = param.data();
  const float* g = grad.data();
  float* m = exp_avg.data();
  float* v = exp_avg_sq.data();
  float* v_max = max_exp_avg_sq.data();
  const size_t n = param.size();
  for (size_t i = 0; i < n; ++i) {
    float p_i = p[i];
    float g_i = g[i];
    if (decoupled) {
      p_i = p_i * decay_factor;
    } else if (wd != 0.0f) {
      g_i = g_i + wd * p_i;
    }
    const float m_i = m[i] * beta1 + one_minus_beta1 * g_i;
    const float v_i = v[i] * beta2 + one_minus_beta2 * g_i * g_i;
    m[i] = m_i;
    v[i] = v_i;
    float second = v_i;
    if (hp.amsgrad) {
      second = v_max[i] > v_i ? v_max[i] : v_i;
      v_max[i] = second;
    }
    const float denom = std::sqrt(second) / bias_correction2_sqrt + eps;
    p[i] = p_i + (-step_size) * (m_i / denom);
  }
}

}  // namespace flatshard::kernels::cpu
