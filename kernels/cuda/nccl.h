// NCCL communicators for the GPU data plane, with NCCL loaded at run time: dlopen of
// $FLATSHARD_NCCL_LIBRARY or "libnccl.so.2". flatshard binaries therefore start on
// machines without NCCL (or without a GPU), and NcclAvailable() says whether this one can
// use it; callers fall back to another data plane when it cannot.
//
// Every blocking step has a deadline: communicators are created non-blocking and
// polled, and a wait that runs out (a dead or absent peer) aborts the communicator
// (ncclCommAbort) and returns DeadlineExceeded, so a request fails with a status rather
// than hanging the process. A wait also ends, the communicator aborted, Cancelled, once a
// stop is asked of its std::stop_token (the caller gave up, or is going away) or its
// PeerGone says the other side gave the transfer up: once it returns, NCCL touches none of
// its buffers. Asynchronous NCCL errors are checked while waiting.
// A communicator is used by one thread at a time (its owner serializes calls).
//
//   std::string id = *NcclCommunicator::NewUniqueId();      // rank 0, sent over gRPC
//   auto comm = NcclCommunicator::Create(id, 2, rank, absl::Seconds(30));
//   (*comm)->Send(buffer, bytes, /*peer=*/1, stream);  (*comm)->Wait(stream, absl::Seconds(30));
#ifndef FLATSHARD_KERNELS_CUDA_NCCL_H_
#define FLATSHARD_KERNELS_CUDA_NCCL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flatshard::kernels::cuda {

// OK with NCCL's version ("2.28.3") when the library loads; FailedPrecondition naming
// what was tried otherwise.
[[nodiscard]] absl::StatusOr<std::string> NcclVersion();

// Whether the other side of a transfer has given it up (its request's connection closed):
// its NCCL will never do its half. Asked by a waiting thread at most every kPeerCheck, as
// it may cost a system call; quick, and takes no lock the waiter may hold.
using PeerGone = std::function<bool()>;
inline constexpr absl::Duration kPeerCheck = absl::Milliseconds(100);

class NcclCommunicator {
 public:
  // A fresh ncclUniqueId (128 bytes) for rank 0 to hand to the other ranks.
  [[nodiscard]] static absl::StatusOr<std::string> NewUniqueId();
  // Joins communicator `unique_id` as `rank` of `nranks` on the current device, waiting
  // at most `timeout` for the other ranks, or until a stop is asked of `stop`
  // (Cancelled).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const std::string& unique_id, int nranks, int rank, absl::Duration timeout, const std::stop_token& stop = {});
  ~NcclCommunicator();  // finalizes and destroys, or aborts if it failed

  // Enqueue point-to-point transfers on `stream` (between GroupStart/GroupEnd, several
  // of them form one NCCL group so that a send and a receive can pair up). The
  // communicator is non-blocking: outside a group, Wait for one operation before the
  // next (NCCL refuses an operation while the last is still being enqueued).
  [[nodiscard]] absl::Status GroupStart();
  [[nodiscard]] absl::Status GroupEnd();
  [[nodiscard]] absl::Status Send(const void* buffer, size_t bytes, int peer, cudaStream_t stream);
  [[nodiscard]] absl::Status Recv(void* buffer, size_t bytes, int peer, cudaStream_t stream);
  // Waits until `stream` has finished its work, checking NCCL's asynchronous errors;
  // aborts the communicator and returns DeadlineExceeded after `timeout`, Cancelled once
  // a stop is asked of `stop` or `peer_gone` (empty: never asked) says so (the transfers
  // under way end unfinished). Work found finished is never reported stopped.
  [[nodiscard]] absl::Status Wait(cudaStream_t stream, absl::Duration timeout, const std::stop_token& stop = {},
                                  const PeerGone& peer_gone = nullptr);

  // Aborts every operation in flight; the communicator is unusable afterwards.
  void Abort();
  int nranks() const { return nranks_; }
  int rank() const { return rank_; }

 private:
  class WaitEnd;  // why a wait ends early, if it does: a stop, or the peer gone

  NcclCommunicator(void* comm, int nranks, int rank) : comm_(comm), nranks_(nranks), rank_(rank) {}
  // Polls until the communicator's pending work (init, group end) is done; ends as Wait.
  absl::Status WaitReady(absl::Duration timeout, WaitEnd& end);
  // Aborts the communicator; the Cancelled status of a wait that ended early, saying why.
  absl::Status AbortEarly(absl::string_view why);

  void* comm_;  // ncclComm_t
  int nranks_;
  int rank_;
  bool failed_ = false;
};

}  // namespace flatshard::kernels::cuda

#endif  // FLATSHARD_KERNELS_CUDA_NCCL_H_
