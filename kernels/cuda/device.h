// Discovery of CUDA devices, in plain C++ (no CUDA header leaks out of this folder).
// Thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(int gpus, kernels::cuda::DeviceCount());
//   if (gpus == 0) { /* CPU-only path */ }
#ifndef FLATSHARD_KERNELS_CUDA_DEVICE_H_
#define FLATSHARD_KERNELS_CUDA_DEVICE_H_

#include <string>

#include "absl/status/statusor.h"

namespace flatshard::kernels::cuda {

// The number of usable CUDA devices. A machine without a driver or without a device
// (cudaErrorInsufficientDriver, cudaErrorNoDevice) has 0; any other failure of the
// runtime is returned as Internal with the CUDA message.
[[nodiscard]] absl::StatusOr<int> DeviceCount();

// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" for device `ordinal`, or Internal.
[[nodiscard]] absl::StatusOr<std::string> DeviceDescription(int ordinal);

// Whether device `ordinal`'s primary context exists in this process, asked without
// creating it (any runtime call on a device does, cudaSetDevice included since CUDA 12).
// True when the driver cannot be asked.
bool HasPrimaryContext(int ordinal);

// Makes `ordinal` the calling thread's current device for its lifetime, then restores
// the device the thread had (runtime calls bind the device's context to the thread).
// The device a thread reports before it ever chose one is 0; it is restored only if
// its context exists, so that a thread of a worker on GPU 3 never creates a context (and
// takes memory) on GPU 0.
class ScopedDevice {
 public:
  explicit ScopedDevice(int ordinal);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_DEVICE_H_
