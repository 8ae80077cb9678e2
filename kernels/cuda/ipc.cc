#include "kernels/cuda/ipc.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/driver_function.h"

namespace flatshard::kernels::cuda {
namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using GetPointerAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

absl::StatusOr<std::pair<CUdeviceptr, size_t>> AddressRange(const void* ptr) {
  static const GetAddressRange get_range = DriverFunction<GetAddressRange>("cuMemGetAddressRange");
  if (get_range == nullptr) return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (get_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%p is not inside a device allocation", ptr));
  }
  return std::make_pair(base, size);
}

// What the driver knows of the allocation holding `ptr`, in one call that needs no
// current context.
struct Allocation {
  unsigned int memory_type = 0;  // CUmemorytype; 0 for memory CUDA does not know
  int device = -1;
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long buffer_id = 0;  // unique to the allocation for the process's life
  int ipc_capable = 0;               // 1 when cudaIpcGetMemHandle works (not pooled or managed)
};

absl::StatusOr<Allocation> AllocationOf(const void* ptr) {
  static const GetPointerAttributes get =
      DriverFunction<GetPointerAttributes>("cuPointerGetAttributes");
  if (get == nullptr) return absl::InternalError("the CUDA driver has no cuPointerGetAttributes");
  Allocation a;
  CUpointer_attribute attributes[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* values[] = {&a.memory_type, &a.device, &a.base, &a.size, &a.buffer_id, &a.ipc_capable};
  if (get(6, attributes, values, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrFormat("%p is not device memory", ptr));
  }
  return a;
}

// Exports already made, by allocation (buffer id): a handle costs a driver round trip
// and stays valid for the allocation's life. Ids are never reused, so a freed
// allocation's entry is never found again; the cache is emptied when it grows large.
class ExportCache {
 public:
  std::optional<std::string> Find(unsigned long long buffer_id) {
    absl::MutexLock lock(&mu_);
    auto it = handles_.find(buffer_id);
    if (it == handles_.end()) return std::nullopt;
    return it->second;
  }
  void Add(unsigned long long buffer_id, std::string handle) {
    absl::MutexLock lock(&mu_);
    if (handles_.size() >= kMaxEntries) handles_.clear();
    handles_.emplace(buffer_id, std::move(handle));
  }

 private:
  static constexpr size_t kMaxEntries = 4096;
  absl::Mutex mu_;
  absl::flat_hash_map<unsigned long long, std::string> handles_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int DeviceOfPointer(const void* ptr) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();  // e.g. no driver: then nothing is device memory
    return -1;
  }
  return attributes.type == cudaMemoryTypeDevice ? attributes.device : -1;
}

absl::StatusOr<std::string> DeviceUuid(int ordinal) {
  // cudaGetDeviceProperties costs a fraction of a millisecond, and transfers ask per call.
  static absl::Mutex mu(absl::kConstInit);
  static auto* known = new absl::flat_hash_map<int, std::string>();
  absl::MutexLock lock(&mu);
  if (auto it = known->find(ordinal); it != known->end()) return it->second;
  cudaDeviceProp prop{};
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal));
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::string uuid =
      absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                      b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                      b[12], b[13], b[14], b[15]);
  known->emplace(ordinal, uuid);
  return uuid;
}

absl::StatusOr<ExportedBuffer> ExportDeviceBuffer(const void* ptr) {
  FLATSHARD_ASSIGN_OR_RETURN(Allocation a, AllocationOf(ptr));
  if (a.memory_type != CU_MEMORYTYPE_DEVICE || a.device < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%p is not device memory", ptr));
  }
  if (!a.ipc_capable) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "device memory at %p cannot be shared with CUDA IPC (allocate it with cudaMalloc, "
        "not from a pool or as managed memory)", ptr));
  }
  static ExportCache* cache = new ExportCache();
  std::optional<std::string> handle = cache->Find(a.buffer_id);
  if (!handle.has_value()) {
    ScopedDevice on_device(a.device);
    cudaIpcMemHandle_t ipc{};
    const cudaError_t err = cudaIpcGetMemHandle(&ipc, reinterpret_cast<void*>(a.base));
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          "device memory at ", absl::StrFormat("%p", ptr),
          " cannot be shared with CUDA IPC (allocate it with cudaMalloc): ", cudaGetErrorString(err)));
    }
    handle = std::string(ipc.reserved, sizeof(ipc.reserved));
    cache->Add(a.buffer_id, *handle);
  }
  return ExportedBuffer{*std::move(handle), reinterpret_cast<uintptr_t>(ptr) - a.base, a.size};
}

OpenMapping::~OpenMapping() { cudaIpcCloseMemHandle(base_); }

absl::StatusOr<MappedBuffer> IpcMappings::Map(const std::string& handle, uint64_t offset,
                                              uint64_t bytes) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t),
                                                   " bytes, not ", handle.size()));
  }
  absl::MutexLock lock(&mu_);
  if (!mappings_.contains(handle)) {
    cudaIpcMemHandle_t ipc{};
    std::memcpy(ipc.reserved, handle.data(), handle.size());
    void* base = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (err == cudaErrorAlreadyMapped) {
      // A worker freed an allocation this cache still maps and got its memory back in a
      // new one. Close the mappings no request holds (stale ones among them), retry.
      cudaGetLastError();
      for (auto it = recency_.begin(); it != recency_.end();) {
        auto entry = mappings_.find(*it);
        if (*it != handle && entry != mappings_.end() && entry->second.use_count() == 1) {
          mappings_.erase(entry);
          it = recency_.erase(it);
        } else {
          ++it;
        }
      }
      err = cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      const std::string message = absl::StrCat("cannot open the worker's CUDA IPC handle: ", cudaGetErrorString(err));
      // A handle of no allocation (or of another GPU's) is the request's fault; the rest
      // (out of memory, a broken context) this server's.
      const bool bad_handle = err == cudaErrorInvalidValue || err == cudaErrorInvalidResourceHandle ||
                              err == cudaErrorInvalidDevice || err == cudaErrorMapBufferObjectFailed;
      return bad_handle ? absl::InvalidArgumentError(message) : absl::InternalError(message);
    }
    absl::StatusOr<std::pair<CUdeviceptr, size_t>> range = AddressRange(base);
    mappings_[handle] = std::make_shared<const OpenMapping>(base, range.ok() ? range->second : 0);
    recency_.push_front(handle);
    while (recency_.size() > capacity_) {
      mappings_.erase(recency_.back());  // closed when its last request lets go
      recency_.pop_back();
    }
  } else {
    recency_.remove(handle);
    recency_.push_front(handle);
  }
  std::shared_ptr<const OpenMapping> mapping = mappings_.at(handle);
  if (offset > mapping->size() || bytes > mapping->size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", ", offset + bytes,
                                                   ") are past the worker's allocation of ",
                                                   mapping->size(), " bytes"));
  }
  return MappedBuffer{mapping, static_cast<char*>(mapping->base()) + offset};
}

}  // namespace flatshard::kernels::cuda
