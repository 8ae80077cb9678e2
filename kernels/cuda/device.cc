#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"

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

ScopedDevice::ScopedDevice(int ordinal) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ != ordinal) cudaSetDevice(ordinal);
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace flatshard::kernels::cuda
