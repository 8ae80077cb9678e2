// Internal to the client: a worker's NCCL communicator with one server, for the NCCL
// data plane (the server is rank 0, this worker rank 1; see server/nccl_plane.h), with
// the CUDA stream its transfers run on. The server moves a channel's transfers one at
// a time in the order its requests arrive, so one caller uses a link from sending a
// request until its transfer is done (client/link_pool.h lends links so). A transfer
// that fails aborts the communicator (failed() turns true) and the client opens a new
// link. In a build without CUDA, Available() is false and Open is FailedPrecondition.
// Thread-safe.
#ifndef FLATSHARD_CLIENT_NCCL_LINK_H_
#define FLATSHARD_CLIENT_NCCL_LINK_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace flatshard::client_internal {

class NcclLink {
 public:
  // Whether NCCL loads in this process.
  static bool Available();
  // Makes an ncclUniqueId, has `open_channel` (the OpenNcclChannel RPC) give it to the
  // server, and joins the communicator on `device` within `timeout`.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NcclLink>> Open(
      int device, absl::Duration timeout,
      const std::function<absl::StatusOr<uint64_t>(const std::string& unique_id)>& open_channel);
  ~NcclLink();
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  uint64_t channel() const { return channel_; }
  int device() const { return device_; }
  bool failed() const;

  // Receives `bytes` from / sends them to the server on this link's stream and waits
  // for the transfer, at most `timeout` (then the communicator is aborted).
  [[nodiscard]] absl::Status Recv(void* dst, size_t bytes, absl::Duration timeout);
  [[nodiscard]] absl::Status Send(const void* src, size_t bytes, absl::Duration timeout);

 private:
  struct State;  // the communicator and stream, in CUDA builds
  NcclLink(int device, uint64_t channel, std::unique_ptr<State> state);
  // Waits for the transfer `enqueued` started; on any failure aborts the communicator.
  absl::Status Complete(absl::Status enqueued, absl::Duration timeout);

  const int device_;
  const uint64_t channel_;
  std::unique_ptr<State> state_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_NCCL_LINK_H_
