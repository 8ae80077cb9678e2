// IpcPlane: the server side of the CUDA IPC data plane (proto IpcGather / IpcScatter),
// for workers on the same GPU as this --memory=device server. It maps the worker's
// exported buffer (cached per allocation) and has the group write the gathered shard
// into it, or copy the gradient out of it into a device staging slot, before the call
// returns. Exactly-once, versions, deadlines and clipping as on the TCP data plane.
// In a build without CUDA, or on a server whose memory is not the device, every call is
// FailedPrecondition. Thread-safe.
#ifndef FLATSHARD_SERVER_IPC_PLANE_H_
#define FLATSHARD_SERVER_IPC_PLANE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "proto/flatshard.pb.h"
#include "server/clip_coordinator.h"
#include "server/registry.h"
#include "server/stats.h"

namespace flatshard::server {

class IpcPlane {
 public:
  IpcPlane(Registry& registry, ClipCoordinator& clip, ServerStats& stats);
  ~IpcPlane();

  // "GPU-..." of the device holding this server's shards, empty when the server does not
  // keep them in device memory (then the plane is off).
  const std::string& gpu_uuid() const { return gpu_uuid_; }
  // Starts the plane when `tier` is the device; anything else leaves it off.
  [[nodiscard]] absl::Status Start(MemoryTier tier);

  // Returns the version written.
  [[nodiscard]] absl::StatusOr<int64_t> Gather(const v1::IpcTransferRequest& request);
  // Returns the group's version after the contribution.
  [[nodiscard]] absl::StatusOr<int64_t> Scatter(const v1::IpcTransferRequest& request);

 private:
  struct Mappings;  // kernels::cuda::IpcMappings, in CUDA builds

  Registry& registry_;
  ClipCoordinator& clip_;
  ServerStats& stats_;
  std::string gpu_uuid_;
  std::unique_ptr<Mappings> mappings_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_IPC_PLANE_H_
