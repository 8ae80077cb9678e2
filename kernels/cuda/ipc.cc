#include "kernels/cuda/ipc.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace flatshard::kernels::cuda {
namespace {

// cuMemGetAddressRange through the runtime's driver entry point, so that nothing links
// libcuda (it exists only where a driver is installed; the runtime loads it lazily).
using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

absl::StatusOr<std::pair<CUdeviceptr, size_t>> AddressRange(const void* ptr) {
  static GetAddressRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<GetAddressRange>(nullptr);
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get_range == nullptr) return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (get_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%p is not inside a device allocation", ptr));
  }
  return std::make_pair(base, size);
}

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
  cudaDeviceProp prop{};
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal));
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

absl::StatusOr<ExportedBuffer> ExportDeviceBuffer(const void* ptr) {
  const int device = DeviceOfPointer(ptr);
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%p is not device memory", ptr));
  }
  // The driver call below needs the device's context current on this thread, which a
  // fresh thread does not have until a runtime call binds it.
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  FLATSHARD_ASSIGN_OR_RETURN(auto range, AddressRange(ptr));
  cudaIpcMemHandle_t handle{};
  const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(range.first));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "device memory at ", absl::StrFormat("%p", ptr),
        " cannot be shared with CUDA IPC (allocate it with cudaMalloc): ", cudaGetErrorString(err)));
  }
  return ExportedBuffer{std::string(handle.reserved, sizeof(handle.reserved)),
                        reinterpret_cast<uintptr_t>(ptr) - range.first, range.second};
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
      return absl::InternalError(absl::StrCat("cannot open the worker's CUDA IPC handle: ",
                                              cudaGetErrorString(err)));
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
