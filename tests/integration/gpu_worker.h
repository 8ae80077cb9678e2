// What integration tests of GPU workers share: whether this machine has a GPU (and NCCL),
// device buffers for a worker's tensors, and the NCCL host ids that make one GPU's
// processes look like separate nodes. In a build without CUDA, HaveGpu and HaveNccl are
// false and DeviceBytes holds nothing. For integration tests only; not thread-safe.
#ifndef FLATSHARD_TESTS_INTEGRATION_GPU_WORKER_H_
#define FLATSHARD_TESTS_INTEGRATION_GPU_WORKER_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>

#include "absl/types/span.h"
#if FLATSHARD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/device.h"
#include "kernels/cuda/nccl.h"
#endif

namespace flatshard::testing {

inline bool HaveGpu() {
#if FLATSHARD_HAVE_CUDA
  absl::StatusOr<int> count = kernels::cuda::DeviceCount();
  return count.ok() && *count > 0;
#else
  return false;
#endif
}

inline bool HaveNccl() {
#if FLATSHARD_HAVE_CUDA
  return kernels::cuda::NcclVersion().ok();
#else
  return false;
#endif
}

// NCCL refuses two ranks on one GPU of one host. Servers started with another
// NCCL_HOSTID than this process's are other nodes to NCCL, which then moves the bytes
// over its socket transport on loopback: the path between nodes, on the one GPU a test
// machine has. Set kNcclServers before starting servers, and kNcclWorkers after.
inline void SetNcclHost(const char* id) {
  setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  setenv("NCCL_HOSTID", id, 1);
}
inline constexpr char kNcclServers[] = "flatshard-test-servers";
inline constexpr char kNcclWorkers[] = "flatshard-test-workers";

// A device buffer for a worker whose tensors live on the GPU (Gather and Scatter then
// use CUDA IPC with same-GPU servers, NCCL where the client chose it, and host staging
// with the others), poisoned. Allocations are at least 2 MiB, as caching allocators
// make them: smaller ones are moved through host staging (client/device_memory.h).
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : size_(bytes) {
#if FLATSHARD_HAVE_CUDA
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(bytes, 2 << 20)), cudaSuccess);
    EXPECT_EQ(cudaMemset(data_, 0xA5, bytes), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // landed before a server writes
#endif
  }
  ~DeviceBytes() {
#if FLATSHARD_HAVE_CUDA
    cudaFree(data_);
#endif
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  absl::Span<std::byte> span() { return {static_cast<std::byte*>(data_), size_}; }
  void Upload([[maybe_unused]] absl::Span<const std::byte> host) {
#if FLATSHARD_HAVE_CUDA
    EXPECT_EQ(cudaMemcpy(data_, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    // Ready for a server's stream: a pageable copy returns before its bytes land.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
#endif
  }
  void Download([[maybe_unused]] absl::Span<std::byte> host) {
#if FLATSHARD_HAVE_CUDA
    EXPECT_EQ(cudaMemcpy(host.data(), data_, host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
#endif
  }

 private:
  void* data_ = nullptr;
  size_t size_;
};

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_INTEGRATION_GPU_WORKER_H_
