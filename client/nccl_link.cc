#include "client/nccl_link.h"

#include <atomic>

#include "core/status_macros.h"
#include "transport/data_protocol.h"
#if FLATSHARD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/device.h"
#include "kernels/cuda/nccl.h"
#endif

namespace flatshard::client_internal {

#if FLATSHARD_HAVE_CUDA
namespace kc = kernels::cuda;

struct NcclLink::State {
  std::unique_ptr<kc::NcclCommunicator> comm;
  cudaStream_t stream = nullptr;
  std::atomic<bool> failed{false};

  // On the link's device. Also frees the stream of a link whose join failed.
  ~State() {
    comm.reset();  // before its stream goes
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

bool NcclLink::Available() { return kc::NcclVersion().ok(); }

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Open(
    int device, absl::Duration timeout,
    const std::function<absl::StatusOr<uint64_t>(const std::string& unique_id)>& open_channel,
    const std::stop_token& stop) {
  kc::ScopedDevice on_device(device);
  FLATSHARD_ASSIGN_OR_RETURN(std::string unique_id, kc::NcclCommunicator::NewUniqueId());
  FLATSHARD_ASSIGN_OR_RETURN(uint64_t channel, open_channel(unique_id));
  auto state = std::make_unique<State>();
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking));
  FLATSHARD_ASSIGN_OR_RETURN(
      state->comm, kc::NcclCommunicator::Create(unique_id, 2, transport::kNcclWorkerRank, timeout, stop));
  return std::unique_ptr<NcclLink>(new NcclLink(device, channel, std::move(state)));
}

NcclLink::NcclLink(int device, uint64_t channel, std::unique_ptr<State> state)
    : device_(device), channel_(channel), state_(std::move(state)) {}

NcclLink::~NcclLink() {
  kc::ScopedDevice on_device(device_);
  state_.reset();
}

bool NcclLink::failed() const { return state_->failed; }

absl::Status NcclLink::Recv(void* dst, size_t bytes, absl::Duration timeout, const std::stop_token& stop,
                            const std::function<bool()>& server_failed) {
  kc::ScopedDevice on_device(device_);
  return Complete(state_->comm->Recv(dst, bytes, transport::kNcclServerRank, state_->stream), timeout, stop,
                  server_failed);
}

absl::Status NcclLink::Send(const void* src, size_t bytes, absl::Duration timeout, const std::stop_token& stop,
                            const std::function<bool()>& server_failed) {
  kc::ScopedDevice on_device(device_);
  return Complete(state_->comm->Send(src, bytes, transport::kNcclServerRank, state_->stream), timeout, stop,
                  server_failed);
}

void NcclLink::Abandon() {
  kc::ScopedDevice on_device(device_);
  state_->comm->Abort();
  state_->failed = true;
}

absl::Status NcclLink::Complete(absl::Status enqueued, absl::Duration timeout, const std::stop_token& stop,
                                const std::function<bool()>& server_failed) {
  if (enqueued.ok()) enqueued = state_->comm->Wait(state_->stream, timeout, stop, server_failed);
  if (!enqueued.ok()) Abandon();
  return enqueued;
}

#else

struct NcclLink::State {};

bool NcclLink::Available() { return false; }

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Open(
    int, absl::Duration, const std::function<absl::StatusOr<uint64_t>(const std::string&)>&,
    const std::stop_token&) {
  return absl::FailedPreconditionError("this client was built without CUDA (no NCCL plane)");
}

NcclLink::NcclLink(int device, uint64_t channel, std::unique_ptr<State> state)
    : device_(device), channel_(channel), state_(std::move(state)) {}
NcclLink::~NcclLink() = default;
bool NcclLink::failed() const { return true; }
absl::Status NcclLink::Recv(void*, size_t, absl::Duration, const std::stop_token&, const std::function<bool()>&) {
  return absl::FailedPreconditionError("this client was built without CUDA");
}
absl::Status NcclLink::Send(const void*, size_t, absl::Duration, const std::stop_token&,
                            const std::function<bool()>&) {
  return absl::FailedPreconditionError("this client was built without CUDA");
}
void NcclLink::Abandon() {}

#endif

}  // namespace flatshard::client_internal
