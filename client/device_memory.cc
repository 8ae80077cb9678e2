#include "client/device_memory.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

#if FLATSHARD_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/status_macros.h"
#include "kernels/cuda/ipc.h"
#endif

namespace flatshard::client_internal {
namespace {

absl::StatusOr<StagingBuffer> AllocateHeap(size_t bytes) {
  void* data = std::malloc(std::max<size_t>(bytes, 1));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host staging memory"));
  }
  return StagingBuffer(data, bytes, &std::free);
}

}  // namespace

#if FLATSHARD_HAVE_CUDA

absl::StatusOr<StagingBuffer> AllocateStagingHost(size_t bytes) {
  void* data = nullptr;
  if (bytes > 0 && cudaHostAlloc(&data, bytes, cudaHostAllocPortable) == cudaSuccess) {
    return StagingBuffer(data, bytes, [](void* pinned) { cudaFreeHost(pinned); });
  }
  cudaGetLastError();  // pinning failed (no driver, or too much pinned): use the heap
  return AllocateHeap(bytes);
}

int DeviceOf(const void* ptr) { return kernels::cuda::DeviceOfPointer(ptr); }

int CurrentDevice() {
  int count = 0, device = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

void UseDevice(int device) {
  if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();  // the next call reports it
}

absl::StatusOr<std::string> DeviceUuid(int device) { return kernels::cuda::DeviceUuid(device); }

absl::StatusOr<IpcExport> ExportForIpc(const void* ptr) {
  FLATSHARD_ASSIGN_OR_RETURN(kernels::cuda::ExportedBuffer exported,
                             kernels::cuda::ExportDeviceBuffer(ptr));
  if (exported.allocation_bytes < kernels::cuda::kMinIpcAllocationBytes) {
    return absl::InvalidArgumentError("allocations under 2 MiB are not shared by CUDA IPC");
  }
  return IpcExport{std::move(exported.handle), exported.offset};
}

absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes) {
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyDefault));
  return absl::OkStatus();
}

absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes) {
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDefault));
  return absl::OkStatus();
}

#else

namespace {
absl::Status NoCuda() { return absl::FailedPreconditionError("this client was built without CUDA"); }
}  // namespace

absl::StatusOr<StagingBuffer> AllocateStagingHost(size_t bytes) { return AllocateHeap(bytes); }
int DeviceOf(const void*) { return -1; }
int CurrentDevice() { return -1; }
void UseDevice(int) {}
absl::StatusOr<std::string> DeviceUuid(int) { return NoCuda(); }
absl::StatusOr<IpcExport> ExportForIpc(const void*) { return NoCuda(); }
absl::Status CopyToDevice(void*, const void*, size_t) { return NoCuda(); }
absl::Status CopyToHost(void*, const void*, size_t) { return NoCuda(); }

#endif

}  // namespace flatshard::client_internal
