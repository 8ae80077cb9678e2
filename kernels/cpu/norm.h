// CPU norm kernels over float32 buffers, for gradient clipping. The squared L2 norm is
// accumulated in double (independent of the order up to double rounding, and exact
// enough to agree with a float64 reference to ~1e-15 relative); the inf-norm is exact.
// NaN and Inf propagate as torch.linalg.vector_norm does. Thread-safe.
//
//   double sq = kernels::cpu::SquaredNorm(grad);   // sum of grad[i]^2
//   float m = kernels::cpu::MaxAbs(grad);          // max |grad[i]|, 0 when empty
#ifndef FLATSHARD_KERNELS_CPU_NORM_H_
#define FLATSHARD_KERNELS_CPU_NORM_H_

#include "absl/types/span.h"

namespace flatshard::kernels::cpu {

double SquaredNorm(absl::Span<const float> x);
float MaxAbs(absl::Span<const float> x);

}  // namespace flatshard::kernels::cpu

#endif  // FLATSHARD_KERNELS_CPU_NORM_H_
