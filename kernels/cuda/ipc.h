// CUDA IPC between a worker process and a server process that share a GPU: the worker
// exports where its device buffer lives (ExportDeviceBuffer), the server maps it once
// and then reads or writes it directly with its kernels (IpcMappings). NCCL refuses two
// ranks on one device, so this is how a worker and a --memory=device server on the same
// GPU exchange bytes without a trip through host memory.
//
// Handles name whole cudaMalloc allocations (cudaIpcGetMemHandle); a buffer inside one
// (a caching allocator's block, a slice) is the handle plus a byte offset. Memory from
// cudaMallocAsync pools or cudaMallocManaged cannot be exported; that is
// InvalidArgument and the caller falls back to another data plane.
//
//   // worker                                  // server
//   auto exported = ExportDeviceBuffer(ptr);   auto mapped = mappings.Map(handle, offset, bytes);
//                                              // use mapped->data while holding *mapped
#ifndef FLATSHARD_KERNELS_CUDA_IPC_H_
#define FLATSHARD_KERNELS_CUDA_IPC_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::kernels::cuda {

// The device `ptr` is on, or -1 when it is host memory (pageable, pinned or unknown to
// CUDA). Never fails: anything CUDA cannot classify is host memory.
int DeviceOfPointer(const void* ptr);

// "GPU-8c5e...": the UUID of device `ordinal`, the same string in every process on the
// node (unlike ordinals, which CUDA_VISIBLE_DEVICES renumbers); cached after the first
// call. Internal on failure.
[[nodiscard]] absl::StatusOr<std::string> DeviceUuid(int ordinal);

struct ExportedBuffer {
  std::string handle;             // cudaIpcMemHandle_t bytes (64)
  uint64_t offset = 0;            // of the buffer inside the exported allocation
  uint64_t allocation_bytes = 0;  // size of that allocation
};

// Allocations below this size may share a memory region with others (the driver
// sub-allocates small cudaMallocs), and a process can map a region only once
// (cudaErrorAlreadyMapped): such buffers are better moved another way.
inline constexpr uint64_t kMinIpcAllocationBytes = uint64_t{2} << 20;

// Exports the allocation holding device pointer `ptr`. InvalidArgument when `ptr` is not
// in exportable device memory. Each allocation's handle is made once and cached; the
// call neither needs nor changes the calling thread's current device.
[[nodiscard]] absl::StatusOr<ExportedBuffer> ExportDeviceBuffer(const void* ptr);

// One worker allocation mapped into this process; closed when the last holder lets go.
class OpenMapping {
 public:
  OpenMapping(void* base, uint64_t size) : base_(base), size_(size) {}
  ~OpenMapping();
  OpenMapping(const OpenMapping&) = delete;
  OpenMapping& operator=(const OpenMapping&) = delete;
  void* base() const { return base_; }
  uint64_t size() const { return size_; }

 private:
  void* const base_;
  const uint64_t size_;
};

// A mapped buffer: `data` stays valid while `mapping` is held.
struct MappedBuffer {
  std::shared_ptr<const OpenMapping> mapping;
  void* data = nullptr;
};

// A server's mappings of workers' exported allocations, opened on first use and kept
// (opening costs milliseconds), at most `capacity`; the least recently used leaves the
// cache when a new one needs room, and is closed once no request holds it.
// Thread-safe.
class IpcMappings {
 public:
  explicit IpcMappings(size_t capacity = 64) : capacity_(capacity) {}
  IpcMappings(const IpcMappings&) = delete;
  IpcMappings& operator=(const IpcMappings&) = delete;

  // `bytes` at `offset` of the allocation `handle` names, mapped on the current device.
  // InvalidArgument for a malformed handle, a range past the allocation or a handle the
  // driver refuses as invalid (no such allocation, another GPU's); Internal with the CUDA
  // error for other failures to open it (out of memory, a broken context).
  [[nodiscard]] absl::StatusOr<MappedBuffer> Map(const std::string& handle, uint64_t offset,
                                                 uint64_t bytes);

 private:
  absl::Mutex mu_;
  const size_t capacity_;
  absl::flat_hash_map<std::string, std::shared_ptr<const OpenMapping>> mappings_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> recency_ ABSL_GUARDED_BY(mu_);  // most recent first
};

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_IPC_H_
