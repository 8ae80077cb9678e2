// One worker's gradient as the reduction kernels (kernels/cpu/reduce.h and
// kernels/cuda/kernels.h) take it: elements of `dtype` at `data`, owned by the caller.
#ifndef FLATSHARD_KERNELS_CONTRIBUTION_H_
#define FLATSHARD_KERNELS_CONTRIBUTION_H_

#include <cstddef>

#include "core/dtype.h"

namespace flatshard::kernels {

struct Contribution {
  DType dtype = DType::kFloat32;  // float32, bfloat16 or float16
  const void* data = nullptr;

  // Where element `elements` of this gradient is.
  const void* At(size_t elements) const {
    return static_cast<const char*>(data) + elements * DTypeSize(dtype);
  }
};

}  // namespace flatshard::kernels

#endif  // FLATSHARD_KERNELS_CONTRIBUTION_H_
