#include "server/ipc_plane.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#if FLATSHARD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/ipc.h"
#endif

namespace flatshard::server {

#if FLATSHARD_HAVE_CUDA
struct IpcPlane::Mappings {
  kernels::cuda::IpcMappings mappings;
};
#else
struct IpcPlane::Mappings {};
#endif

IpcPlane::IpcPlane(Registry& registry, StepDriver& driver, ServerStats& stats)
    : registry_(registry), driver_(driver), stats_(stats) {}
IpcPlane::~IpcPlane() = default;

absl::Status IpcPlane::Start(MemoryTier tier) {
  if (tier != MemoryTier::kDevice) return absl::OkStatus();
#if FLATSHARD_HAVE_CUDA
  int device = 0;
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  FLATSHARD_ASSIGN_OR_RETURN(gpu_uuid_, kernels::cuda::DeviceUuid(device));
  mappings_ = std::make_unique<Mappings>();
#endif
  return absl::OkStatus();
}

#if FLATSHARD_HAVE_CUDA
namespace {

struct Resolved {
  std::shared_ptr<Group> group;
  DType dtype;
  kernels::cuda::MappedBuffer buffer;
};

absl::StatusOr<Resolved> Resolve(Registry& registry, kernels::cuda::IpcMappings& mappings,
                                 const transport::Request& request,
                                 const transport::IpcTarget& target) {
  FLATSHARD_ASSIGN_OR_RETURN(std::shared_ptr<Group> group,
                             registry.FindGroup(request.job, request.group));
  FLATSHARD_RETURN_IF_ERROR(group->CheckShardBytes(request.dtype, target.bytes, "CUDA IPC"));
  FLATSHARD_ASSIGN_OR_RETURN(
      kernels::cuda::MappedBuffer buffer,
      mappings.Map(std::string(target.handle, sizeof(target.handle)), target.offset, target.bytes));
  return Resolved{std::move(group), request.dtype, std::move(buffer)};
}

}  // namespace
#endif

absl::StatusOr<StateStamp> IpcPlane::Gather(const transport::Request& request, const transport::IpcTarget& target,
                                            const CallerGone& caller_gone) {
#if FLATSHARD_HAVE_CUDA
  if (mappings_ != nullptr) {
    FLATSHARD_ASSIGN_OR_RETURN(Resolved r, Resolve(registry_, mappings_->mappings, request, target));
    FLATSHARD_ASSIGN_OR_RETURN(StateStamp state, r.group->GatherInto(request.version, r.dtype, r.buffer.data,
                                                                     request.Deadline(), caller_gone));
    ++stats_.gathers;
    ++stats_.ipc_gathers;
    stats_.bytes_sent += static_cast<int64_t>(target.bytes);
    return state;
  }
#endif
  (void)request;
  (void)target;
  (void)caller_gone;
  return absl::FailedPreconditionError(
      "this server does not keep its shards in GPU memory; use the TCP data plane");
}

absl::StatusOr<StateStamp> IpcPlane::Scatter(const transport::Request& request, const transport::IpcTarget& target) {
#if FLATSHARD_HAVE_CUDA
  if (mappings_ != nullptr) {
    FLATSHARD_ASSIGN_OR_RETURN(Resolved r, Resolve(registry_, mappings_->mappings, request, target));
    FLATSHARD_ASSIGN_OR_RETURN(ReceiveSlot slot,
                               driver_.BeginScatter(*r.group, request.version, request.worker_rank, r.dtype,
                                                    request.Deadline(), SlotMemory::kDevice, {}, request.load_id));
    if (absl::Status filled = r.group->FillDeviceSlot(slot, r.buffer.data); !filled.ok()) {
      r.group->AbortScatter(slot);
      return filled;
    }
    FLATSHARD_ASSIGN_OR_RETURN(CommitOutcome outcome, r.group->CommitScatter(slot));
    ++stats_.scatters;
    ++stats_.ipc_scatters;
    stats_.bytes_received += static_cast<int64_t>(target.bytes);
    FLATSHARD_RETURN_IF_ERROR(driver_.Continue(*r.group, request.version, outcome));
    return r.group->state();
  }
#endif
  (void)request;
  (void)target;
  return absl::FailedPreconditionError(
      "this server does not keep its shards in GPU memory; use the TCP data plane");
}

}  // namespace flatshard::server
