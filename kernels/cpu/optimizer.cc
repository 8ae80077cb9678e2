#include "kernels/cpu/optimizer.h"

#include "kernels/cpu/multiversion.h"
#include "kernels/optimizer_math.h"

namespace flatshard::kernels::cpu {

FLATSHARD_MULTIVERSION void SgdStep(const SgdHyperparams& hp, bool first_step,
                                    absl::Span<float> param, absl::Span<const float> grad,
                                    absl::Span<float> momentum_buffer) {
  float* p = param.data();
  const float* g = grad.data();
  const size_t n = param.size();
  if (hp.momentum == 0.0f) {
    float unused = 0.0f;
    for (size_t i = 0; i < n; ++i) SgdElement(hp, first_step, p[i], g[i], unused);
    return;
  }
  float* buf = momentum_buffer.data();
  for (size_t i = 0; i < n; ++i) SgdElement(hp, first_step, p[i], g[i], buf[i]);
}

FLATSHARD_MULTIVERSION void AdamStep(const AdamHyperparams& hp, int64_t step,
                                     absl::Span<float> param, absl::Span<const float> grad,
                                     absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                                     absl::Span<float> max_exp_avg_sq) {
  const AdamScalars s = MakeAdamScalars(hp, step);
  float* p = param.data();
  const float* g = grad.data();
  float* m = exp_avg.data();
  float* v = exp_avg_sq.data();
  const size_t n = param.size();
  if (hp.amsgrad) {
    float* v_max = max_exp_avg_sq.data();
    for (size_t i = 0; i < n; ++i) AdamElement(s, p[i], g[i], m[i], v[i], v_max[i]);
    return;
  }
  float unused = 0.0f;
  for (size_t i = 0; i < n; ++i) AdamElement(s, p[i], g[i], m[i], v[i], unused);
}

}  // namespace flatshard::kernels::cpu
