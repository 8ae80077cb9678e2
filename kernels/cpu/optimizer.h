// Fused single-pass CPU optimizer updates on fp32 shards, with the exact update rules of
// torch.optim (PyTorch 1.13 single-tensor path): each kernel reads p, g and the state
// once and writes p and the state once. Scalars that torch computes in Python (bias
// corrections) are computed in double here and rounded to float as torch does when it
// passes them to a float32 tensor op. Padding (p = g = 0) stays exactly 0.
// Thread-safe on distinct buffers; the loops vectorize (built with -fno-math-errno).
//
//   AdamHyperparams adam{.lr = 1e-3f, .weight_decay = 0.01f, .decoupled_weight_decay = true};
//   kernels::cpu::AdamStep(adam, /*step=*/1, param, grad, exp_avg, exp_avg_sq, {});
#ifndef FLATSHARD_KERNELS_CPU_OPTIMIZER_H_
#define FLATSHARD_KERNELS_CPU_OPTIMIZER_H_

#include <cstdint>

#include "absl/types/span.h"
#include "kernels/hyperparams.h"

namespace flatshard::kernels::cpu {

// torch.optim.SGD. `momentum_buffer` is used when momentum != 0 (same size as param);
// `first_step` says the buffer is not initialized yet (torch: buf = clone(d_p)).
void SgdStep(const SgdHyperparams& hp, bool first_step, absl::Span<float> param,
             absl::Span<const float> grad, absl::Span<float> momentum_buffer);

// torch.optim.Adam / AdamW for optimizer step `step` (1 for the first). `max_exp_avg_sq`
// is used only with amsgrad. All spans have param's size.
void AdamStep(const AdamHyperparams& hp, int64_t step, absl::Span<float> param,
              absl::Span<const float> grad, absl::Span<float> exp_avg,
              absl::Span<float> exp_avg_sq, absl::Span<float> max_exp_avg_sq);

}  // namespace flatshard::kernels::cpu

#endif  // FLATSHARD_KERNELS_CPU_OPTIMIZER_H_
