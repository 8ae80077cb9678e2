// The per-element update rules of the fused optimizers (torch.optim's single-tensor
// path), shared by the CPU loops (kernels/cpu/optimizer.cc) and the CUDA kernels
// (kernels/cuda/optimizer.cu) so that both compute bit for bit the same values: one
// definition, no contraction into FMA on either side (-ffp-contract=off, nvcc
// --fmad=false), IEEE sqrt and division on both. Pure functions; thread-safe.
//
//   const AdamScalars s = MakeAdamScalars(hp, step);        // once per step, on the host
//   AdamElement(s, p[i], g[i], m[i], v[i], v_max_i);         // per element
#ifndef FLATSHARD_KERNELS_OPTIMIZER_MATH_H_
#define FLATSHARD_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "kernels/hyperparams.h"

namespace flatshard::kernels {

// The step's scalars, computed once on the host as torch computes them in Python
// (double) and rounds them to float when it hands them to a float32 tensor op.
struct AdamScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  float decay_factor;  // AdamW: param.mul_(1 - lr * wd)
  float step_size;     // lr / (1 - beta1^step)
  float bias_correction2_sqrt;
  bool decoupled, amsgrad;
};

inline AdamScalars MakeAdamScalars(const AdamHyperparams& hp, int64_t step) {
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(hp.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(hp.beta2), step);
  return AdamScalars{
      .beta1 = hp.beta1,
      .beta2 = hp.beta2,
      .one_minus_beta1 = 1.0f - hp.beta1,
      .one_minus_beta2 = 1.0f - hp.beta2,
      .eps = hp.eps,
      .weight_decay = hp.weight_decay,
      .decay_factor = 1.0f - hp.lr * hp.weight_decay,
      .step_size = static_cast<float>(hp.lr / bias_correction1),
      .bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2)),
      .decoupled = hp.decoupled_weight_decay,
      .amsgrad = hp.amsgrad,
  };
}

// One Adam/AdamW element. `v_max` is read and written only with amsgrad.
FLATSHARD_HOST_DEVICE inline void AdamElement(const AdamScalars& s, float& p, float g, float& m,
                                              float& v, float& v_max) {
  float p_i = p;
  if (s.decoupled) {
    p_i = p_i * s.decay_factor;
  } else if (s.weight_decay != 0.0f) {
    g = g + s.weight_decay * p_i;
  }
  const float m_i = m * s.beta1 + s.one_minus_beta1 * g;
  const float v_i = v * s.beta2 + s.one_minus_beta2 * g * g;
  m = m_i;
  v = v_i;
  float second = v_i;
  if (s.amsgrad) {
    second = v_max > v_i ? v_max : v_i;
    v_max = second;
  }
  const float denom = std::sqrt(second) / s.bias_correction2_sqrt + s.eps;
  p = p_i + (-s.step_size) * (m_i / denom);
}

// One SGD element. `buf` (the momentum buffer) is read only when momentum != 0 and not
// first_step, and written only when momentum != 0 (torch: buf = clone(d_p) first).
FLATSHARD_HOST_DEVICE inline void SgdElement(const SgdHyperparams& hp, bool first_step, float& p,
                                             float g, float& buf) {
  const float d_p = hp.weight_decay != 0.0f ? g + hp.weight_decay * p : g;
  if (hp.momentum == 0.0f) {
    p = p + (-hp.lr) * d_p;
    return;
  }
  const float b = first_step ? d_p : buf * hp.momentum + (1.0f - hp.dampening) * d_p;
  buf = b;
  const float update = hp.nesterov ? d_p + hp.momentum * b : b;
  p = p + (-hp.lr) * update;
}

}  // namespace flatshard::kernels

#endif  // FLATSHARD_KERNELS_OPTIMIZER_MATH_H_
