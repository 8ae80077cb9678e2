// Internal to the client: a worker's NCCL communicator with one server, for the NCCL
// data plane (the server is rank 0, this worker rank 1; see server/nccl_plane.h), with
// the CUDA stream its transfers run on. The server moves a channel's transfers one at
// a time in the order its requests arrive, so one caller uses a link from sending a
// request until its transfer is done (client/link_pool.h lends links so). A transfer
// that fails aborts the communicator (failed() turns true) and the client opens a new
// link. A stop asked of the token a call takes ends its wait at once, Cancelled, the
// communicator aborted (failed()), so that NCCL no longer touches the call's buffer; so
// does the server's half failing, as the caller's `server_failed` tells. In
// a build without CUDA, Available() is false and Open is FailedPrecondition.
// Thread-safe.
#ifndef FLATSHARD_CLIENT_NCCL_LINK_H_
#define FLATSHARD_CLIENT_NCCL_LINK_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace flatshard::client_internal {

class NcclLink {
 public:
  // Whether NCCL loads in this process.
  static bool Available();
  // Makes an ncclUniqueId, has `open_channel` (the OpenNcclChannel RPC) give it to the
  // server, and joins the communicator on `device` within `timeout`; a stop asked of
  // `stop` ends the join (`open_channel` is the one to take it for the RPC).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NcclLink>> Open(
      int device, absl::Duration timeout,
      const std::function<absl::StatusOr<uint64_t>(const std::string& unique_id)>& open_channel,
      const std::stop_token& stop);
  ~NcclLink();
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  uint64_t channel() const { return channel_; }
  int device() const { return device_; }
  bool failed() const;

  // Receives `bytes` from / sends them to the server on this link's stream and waits
  // for the transfer, at most `timeout`, until a stop is asked of `stop`, or until
  // `server_failed` (asked every 0.1 s; empty: never) says the server's half will not
  // come (then the communicator is aborted, Cancelled).
  [[nodiscard]] absl::Status Recv(void* dst, size_t bytes, absl::Duration timeout, const std::stop_token& stop,
                                  const std::function<bool()>& server_failed = nullptr);
  [[nodiscard]] absl::Status Send(const void* src, size_t bytes, absl::Duration timeout, const std::stop_token& stop,
                                  const std::function<bool()>& server_failed = nullptr);
  // Aborts the communicator (failed() turns true), for a link whose server may still
  // move bytes on it for a request this process gave up before its own part began.
  void Abandon();

 private:
  struct State;  // the communicator and stream, in CUDA builds
  NcclLink(int device, uint64_t channel, std::unique_ptr<State> state);
  // Waits for the transfer `enqueued` started; on any failure aborts the communicator.
  absl::Status Complete(absl::Status enqueued, absl::Duration timeout, const std::stop_token& stop,
                        const std::function<bool()>& server_failed);

  const int device_;
  const uint64_t channel_;
  std::unique_ptr<State> state_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_NCCL_LINK_H_
