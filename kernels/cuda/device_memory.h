// Owning handles for CUDA memory: DeviceMemory (cudaMalloc on the current device) and
// PinnedMemory (cudaHostAlloc, portable and mapped: page-locked host memory that kernels
// read and write through the same pointer under unified addressing, and that DMA
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

enum class MemoryKind { kDevice, kPinned };

template <MemoryKind kKind>
class CudaMemory {
 public:
  CudaMemory() = default;
  [[nodiscard]] static absl::StatusOr<CudaMemory> Allocate(size_t bytes, absl::string_view what);
  CudaMemory(CudaMemory&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  CudaMemory& operator=(CudaMemory&& other) noexcept {
    if (this != &other) {
      Free(data_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~CudaMemory() { Free(data_); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }
  // Gives up ownership: the caller frees the memory with Free().
  [[nodiscard]] void* release() {
    size_ = 0;
    return std::exchange(data_, nullptr);
  }
  // cudaFree or cudaFreeHost; null is ignored.
  static void Free(void* data);

 private:
  CudaMemory(void* data, size_t size) : data_(data), size_(size) {}
  void* data_ = nullptr;
  size_t size_ = 0;
};

using DeviceMemory = CudaMemory<MemoryKind::kDevice>;
using PinnedMemory = CudaMemory<MemoryKind::kPinned>;

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_DEVICE_MEMORY_H_
