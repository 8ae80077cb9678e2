#include "kernels/cuda/device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/cuda/driver_function.h"

namespace flatshard::kernels::cuda {

absl::StatusOr<int> DeviceCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  FLATSHARD_CUDA_RETURN_IF_ERROR(err);
  return count;
}

absl::StatusOr<std::string> DeviceDescription(int ordinal) {
  cudaDeviceProp prop{};
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal));
  return absl::StrFormat("%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                         static_cast<double>(prop.totalGlobalMem) / (1 << 30));
}

bool HasPrimaryContext(int ordinal) {
  using GetDevice = CUresult (*)(CUdevice*, int);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  static const GetDevice get_device = DriverFunction<GetDevice>("cuDeviceGet");
  static const GetState get_state = DriverFunction<GetState>("cuDevicePrimaryCtxGetState");
  if (get_device == nullptr || get_state == nullptr) return true;
  CUdevice device = 0;
  unsigned int flags = 0;
  int active = 0;
  if (get_device(&device, ordinal) != CUDA_SUCCESS || get_state(device, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

ScopedDevice::ScopedDevice(int ordinal) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ == ordinal) {
    previous_ = -1;  // nothing to restore
    return;
  }
  // A thread that never chose a device reports 0: restoring it would create its context.
  if (previous_ >= 0 && !HasPrimaryContext(previous_)) previous_ = -1;
  cudaSetDevice(ordinal);
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace flatshard::kernels::cuda
