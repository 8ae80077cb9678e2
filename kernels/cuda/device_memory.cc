#include "kernels/cuda/device_memory.h"

#include <cuda_runtime.h>

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

template <MemoryKind kKind>
absl::StatusOr<CudaMemory<kKind>> CudaMemory<kKind>::Allocate(size_t bytes, absl::string_view what) {
  if (bytes == 0) return CudaMemory();
  void* data = nullptr;
  const bool device = kKind == MemoryKind::kDevice;
  const cudaError_t err = device ? cudaMalloc(&data, bytes)
                                 : cudaHostAlloc(&data, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    return AllocationError(err, device ? "cudaMalloc" : "cudaHostAlloc", bytes, what);
  }
  return CudaMemory(data, bytes);
}

template <MemoryKind kKind>
void CudaMemory<kKind>::Free(void* data) {
  if (data == nullptr) return;
  if constexpr (kKind == MemoryKind::kDevice) {
    cudaFree(data);
  } else {
    cudaFreeHost(data);
  }
}

template class CudaMemory<MemoryKind::kDevice>;
template class CudaMemory<MemoryKind::kPinned>;

}  // namespace flatshard::kernels::cuda
