// CPU kernel that reduces the workers' gradients of one step into a float32 gradient:
//   dst[i] = alpha * (float(c[0][i]) + float(c[1][i]) + ... + float(c[W-1][i]))
// summed in contribution (worker-rank) order with one rounding per addition; the product
// is taken only when alpha != 1. That is bit for bit Cast of the first, Accumulate of
// each further one and Scale, but in one pass over memory: block by block, so `dst`
// stays in cache and each contribution is read once. Thread-safe; callers own the
// buffers, which must not overlap.
//
//   FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Reduce(contributions, absl::MakeSpan(grad), 0.5f));
#ifndef FLATSHARD_KERNELS_CPU_REDUCE_H_
#define FLATSHARD_KERNELS_CPU_REDUCE_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/contribution.h"

namespace flatshard::kernels::cpu {

// Each contribution holds dst.size() elements. InvalidArgument when there is none or a
// dtype is not float32, bfloat16 or float16 (nothing is written then).
[[nodiscard]] absl::Status Reduce(absl::Span<const Contribution> contributions,
                                  absl::Span<float> dst, float alpha);

}  // namespace flatshard::kernels::cpu

#endif  // FLATSHARD_KERNELS_CPU_REDUCE_H_
