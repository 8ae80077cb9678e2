#include "kernels/cuda/device_memory.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace flatshard::kernels::cuda {
namespace {

absl::Status AllocationError(cudaError_t err, const char* call, size_t bytes,
                             absl::string_view what) {
  cudaGetLastError();  // an allocation failure is not sticky; clear it for later calls
  const std::string message = absl::StrCat(call, " of ", bytes, " bytes for ", what,
                                           " failed: ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace

absl::StatusOr<DeviceMemory> DeviceMemory::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return DeviceMemory();
  void* data = nullptr;
  const cudaError_t err = cudaMalloc(&data, bytes);
  if (err != cudaSuccess) return AllocationError(err, "cudaMalloc", bytes, what);
  return DeviceMemory(data, bytes);
}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

DeviceMemory::~DeviceMemory() {
  if (data_ != nullptr) cudaFree(data_);
}

absl::StatusOr<PinnedMemory> PinnedMemory::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return PinnedMemory();
  void* data = nullptr;
  const cudaError_t err = cudaHostAlloc(&data, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) return AllocationError(err, "cudaHostAlloc", bytes, what);
  return PinnedMemory(data, bytes);
}

PinnedMemory::PinnedMemory(PinnedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PinnedMemory& PinnedMemory::operator=(PinnedMemory&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

PinnedMemory::~PinnedMemory() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

}  // namespace flatshard::kernels::cuda
