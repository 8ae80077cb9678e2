// Owning handles for CUDA memory: DeviceMemory (cudaMalloc on the current device) and
// PinnedMemory (cudaHostAlloc, portable and mapped: page-locked host memory that kernels
// read and write through the same pointer (unified addressing) and DMA
// engines copy at full speed). Move-only; the memory is freed on destruction. An
// allocation the device cannot satisfy is ResourceExhausted naming `what` and the bytes
// asked, never a crash. The handles are not synchronized: one owner at a time.
//
//   FLATSHARD_ASSIGN_OR_RETURN(DeviceMemory grad, DeviceMemory::Allocate(bytes, "group 'mlp' grad"));
//   kernels::cuda::Scale(grad.as<float>(), n, 0.5f, stream);
#ifndef FLATSHARD_KERNELS_CUDA_DEVICE_MEMORY_H_
#define FLATSHARD_KERNELS_CUDA_DEVICE_MEMORY_H_

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::kernels::cuda {

class DeviceMemory {
 public:
  DeviceMemory() = default;
  [[nodiscard]] static absl::StatusOr<DeviceMemory> Allocate(size_t bytes, absl::string_view what);
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  ~DeviceMemory();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }
  // Gives up ownership: the caller frees the memory (cudaFree).
  [[nodiscard]] void* release() {
    size_ = 0;
    return std::exchange(data_, nullptr);
  }

 private:
  DeviceMemory(void* data, size_t size) : data_(data), size_(size) {}
  void* data_ = nullptr;
  size_t size_ = 0;
};

class PinnedMemory {
 public:
  PinnedMemory() = default;
  [[nodiscard]] static absl::StatusOr<PinnedMemory> Allocate(size_t bytes, absl::string_view what);
  PinnedMemory(PinnedMemory&& other) noexcept;
  PinnedMemory& operator=(PinnedMemory&& other) noexcept;
  ~PinnedMemory();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }
  // Gives up ownership: the caller frees the memory (cudaFreeHost).
  [[nodiscard]] void* release() {
    size_ = 0;
    return std::exchange(data_, nullptr);
  }

 private:
  PinnedMemory(void* data, size_t size) : data_(data), size_(size) {}
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_DEVICE_MEMORY_H_
