// DriverFunction: a CUDA driver API function through the runtime's entry points, so that
// nothing links libcuda (it exists only where a driver is installed; the runtime loads
// it lazily). Internal to kernels/cuda. Thread-safe.
//
//   using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
//   static const GetState get_state = DriverFunction<GetState>("cuDevicePrimaryCtxGetState");
//   if (get_state == nullptr) { /* the driver lacks it, or there is no driver */ }
#ifndef FLATSHARD_KERNELS_CUDA_DRIVER_FUNCTION_H_
#define FLATSHARD_KERNELS_CUDA_DRIVER_FUNCTION_H_

#include <cuda_runtime.h>

namespace flatshard::kernels::cuda {

// Null when the driver lacks `name` (or there is no driver).
template <typename Fn>
Fn DriverFunction(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_DRIVER_FUNCTION_H_
