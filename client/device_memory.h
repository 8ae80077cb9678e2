// Internal to the client: what it needs to know and do about device (GPU) buffers passed
// to Gather and Scatter. In a build without CUDA every buffer is host memory and the
// other functions are never reached (they return FailedPrecondition).
#ifndef FLATSHARD_CLIENT_DEVICE_MEMORY_H_
#define FLATSHARD_CLIENT_DEVICE_MEMORY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/staging_pool.h"

namespace flatshard::client_internal {

// The CUDA device holding `ptr`, or -1 for host memory.
int DeviceOf(const void* ptr);
// The CUDA device this thread uses (cudaGetDevice), or -1 when there is none.
int CurrentDevice();
// Makes `device` current on this thread, one of the client's own (it stays so): a thread
// that never chose a device would otherwise create a context on device 0 at its first
// CUDA call, taking memory on a GPU that may be another worker's.
void UseDevice(int device);
// "GPU-..." of `device`.
[[nodiscard]] absl::StatusOr<std::string> DeviceUuid(int device);

struct IpcExport {
  std::string handle;
  uint64_t offset = 0;  // of the exported pointer inside its allocation
};
// A CUDA IPC export of the allocation holding device pointer `ptr`. InvalidArgument when
// it cannot be exported, or when the allocation is below 2 MiB (small cudaMallocs share
// memory regions, which a server can map only once): those go through host staging.
[[nodiscard]] absl::StatusOr<IpcExport> ExportForIpc(const void* ptr);

// Host memory for staging transfers of `bytes` between a device buffer and TCP: pinned
// (cudaHostAlloc) where that succeeds, plain heap memory otherwise. Not zeroed.
// ResourceExhausted when neither can be had.
[[nodiscard]] absl::StatusOr<StagingBuffer> AllocateStagingHost(size_t bytes);

// Synchronous copies between device and host memory.
[[nodiscard]] absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes);
[[nodiscard]] absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_DEVICE_MEMORY_H_
