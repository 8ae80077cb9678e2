// The numeric routines of flatshard, one header per family. This umbrella header is plain
// C++ (it never includes CUDA headers) and lists the CPU reference implementations that
// every build has:
//   kernels/cpu/cast.h        float32 <-> bfloat16 / float16
//   kernels/cpu/accumulate.h  float32 += any float dtype
//   kernels/cpu/reduce.h      the workers' gradients summed (and scaled) in one pass
//   kernels/cpu/scale.h       x *= alpha
//   kernels/cpu/norm.h        squared L2 norm (double accumulation), max |x|
//   kernels/cpu/optimizer.h   fused SGD / Adam / AdamW updates (torch.optim rules)
// CUDA builds add the same families under kernels/cuda/ (FLATSHARD_HAVE_CUDA).
#ifndef FLATSHARD_KERNELS_KERNELS_H_
#define FLATSHARD_KERNELS_KERNELS_H_

#include "kernels/cpu/accumulate.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/scale.h"

#endif  // FLATSHARD_KERNELS_KERNELS_H_
