// IpcPlane: the server side of the CUDA IPC data plane (data-plane ops kIpcGather and
// kIpcScatter, served by DataServer on the worker's data connections), for workers on
// the same GPU as this --memory=device server. It maps the worker's
// exported buffer (cached per allocation) and has the group write the gathered shard
// into it, or copy the gradient out of it into a device staging slot, before the call
// returns. Exactly-once, versions, deadlines, clipping and hybrid sharding as on the TCP data plane.
// In a build without CUDA, or on a server whose memory is not the device, every call is
// FailedPrecondition. Thread-safe.
#ifndef FLATSHARD_SERVER_IPC_PLANE_H_
#define FLATSHARD_SERVER_IPC_PLANE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/caller_wait.h"
#include "server/registry.h"
#include "server/stats.h"
#include "server/step_driver.h"
#include "transport/data_protocol.h"

namespace flatshard::server {

class IpcPlane {
 public:
  IpcPlane(Registry& registry, StepDriver& driver, ServerStats& stats);
  ~IpcPlane();

  // "GPU-..." of the device holding this server's shards, empty when the server does not
  // keep them in device memory (then the plane is off).
  const std::string& gpu_uuid() const { return gpu_uuid_; }
  // Starts the plane when `tier` is the device; anything else leaves it off.
  [[nodiscard]] absl::Status Start(MemoryTier tier);

  // `request` (kIpcGather) names the group, dtype and min_version; `target` the worker's
  // buffer. Returns the state written; Cancelled, writing nothing, once `caller_gone`
  // says the worker went away while the gather waited for its version.
  [[nodiscard]] absl::StatusOr<StateStamp> Gather(const transport::Request& request, const transport::IpcTarget& target,
                                                  const CallerGone& caller_gone = nullptr);
  // `request` (kIpcScatter) names the group, dtype, step, worker and the load the gradient
  // was computed from. Returns the group's state after the contribution.
  [[nodiscard]] absl::StatusOr<StateStamp> Scatter(const transport::Request& request,
                                                   const transport::IpcTarget& target);

 private:
  struct Mappings;  // kernels::cuda::IpcMappings, in CUDA builds

  Registry& registry_;
  StepDriver& driver_;
  ServerStats& stats_;
  std::string gpu_uuid_;
  std::unique_ptr<Mappings> mappings_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_IPC_PLANE_H_
