// CPU kernel that multiplies a float32 buffer in place: x[i] *= alpha. Used for the
// mean reduction (1/W) and for gradient clipping. Thread-safe on distinct buffers.
//
//   kernels::cpu::Scale(absl::MakeSpan(grad), 1.0f / num_workers);
#ifndef FLATSHARD_KERNELS_CPU_SCALE_H_
#define FLATSHARD_KERNELS_CPU_SCALE_H_

#include "absl/types/span.h"

namespace flatshard::kernels::cpu {

void Scale(absl::Span<float> x, float alpha);

}  // namespace flatshard::kernels::cpu

#endif  // FLATSHARD_KERNELS_CPU_SCALE_H_
