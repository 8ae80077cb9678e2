#include "server/nccl_plane.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/status_macros.h"
#if FLATSHARD_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/nccl.h"
#endif

namespace flatshard::server {

#if FLATSHARD_HAVE_CUDA
namespace kc = kernels::cuda;

namespace {

constexpr size_t kMaxChannels = 64;

// One worker's communicator with this server: joined in the background, then used by
// one transfer at a time (transfer_mu, held from Begin to the end of Finish).
struct Channel {
  uint64_t id = 0;
  int worker_rank = 0;
  std::mutex transfer_mu;
  absl::Notification joined;
  absl::Status join_status;  // set before `joined` is notified
  std::unique_ptr<kc::NcclCommunicator> comm;
  cudaStream_t stream = nullptr;
  kc::DeviceMemory staging;  // a gather's shard in the gather dtype; grows as needed
  std::thread joiner;

  ~Channel() {
    if (joiner.joinable()) joiner.join();
    comm.reset();  // before its stream goes
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

}  // namespace

struct NcclPlane::State {
  int device = 0;
  std::stop_source closing;  // asked by ~NcclPlane: a join still waiting for its worker ends
  absl::Mutex mu;
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  std::map<uint64_t, std::shared_ptr<Channel>> channels ABSL_GUARDED_BY(mu);

  std::shared_ptr<Channel> Find(uint64_t id) {
    absl::MutexLock lock(&mu);
    auto it = channels.find(id);
    return it == channels.end() ? nullptr : it->second;
  }
  void Close(uint64_t id) {
    std::shared_ptr<Channel> closed;  // destroyed outside the lock
    absl::MutexLock lock(&mu);
    if (auto it = channels.find(id); it != channels.end()) {
      closed = std::move(it->second);
      channels.erase(it);
    }
  }
};

class NcclPlane::Transfer {
 public:
  Transfer(NcclPlane::State& state, std::shared_ptr<Channel> channel, std::shared_ptr<Group> group,
           const transport::Request& request)
      : state_(state),
        channel_(std::move(channel)),
        lock_(channel_->transfer_mu),
        group_(std::move(group)),
        request_(request) {}
  ~Transfer() {
    // Begun but never finished: the worker was not told to start, so nothing moved.
    if (slot_.has_value()) group_->AbortScatter(*slot_);
  }

  Channel& channel() { return *channel_; }
  Group& group() { return *group_; }
  const transport::Request& request() const { return request_; }
  std::optional<ReceiveSlot>& slot() { return slot_; }
  size_t bytes = 0;
  StateStamp staged;  // a gather's staged state

  // The transfer failed: the communicator is aborted and the channel closed.
  void CloseChannel() { state_.Close(channel_->id); }

 private:
  NcclPlane::State& state_;
  std::shared_ptr<Channel> channel_;
  std::unique_lock<std::mutex> lock_;
  std::shared_ptr<Group> group_;
  transport::Request request_;
  std::optional<ReceiveSlot> slot_;
};
#else
struct NcclPlane::State {};
class NcclPlane::Transfer {};
#endif

NcclPlane::NcclPlane(Registry& registry, StepDriver& driver, ServerStats& stats,
                     absl::Duration timeout)
    : registry_(registry), driver_(driver), stats_(stats), timeout_(timeout) {}

NcclPlane::~NcclPlane() {
#if FLATSHARD_HAVE_CUDA
  if (state_ != nullptr) state_->closing.request_stop();  // before the channels join their joiners
#endif
}

absl::Status NcclPlane::Start(MemoryTier tier) {
#if FLATSHARD_HAVE_CUDA
  if (tier != MemoryTier::kDevice) return absl::OkStatus();
  absl::StatusOr<std::string> version = kc::NcclVersion();
  if (!version.ok()) return absl::OkStatus();  // no NCCL here: the other planes serve
  auto state = std::make_unique<State>();
  FLATSHARD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&state->device));
  state_ = std::move(state);
  version_ = *version;
#else
  (void)tier;
#endif
  return absl::OkStatus();
}

namespace {
absl::Status Off() {
  return absl::FailedPreconditionError(
      "this server has no NCCL data plane (its shards are not in GPU memory, or NCCL did not "
      "load); use CUDA IPC or TCP");
}
}  // namespace

absl::StatusOr<uint64_t> NcclPlane::Open(const std::string& unique_id, int worker_rank) {
#if FLATSHARD_HAVE_CUDA
  if (state_ == nullptr) return Off();
  if (unique_id.size() != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id has 128 bytes, not ", unique_id.size()));
  }
  auto channel = std::make_shared<Channel>();
  channel->worker_rank = worker_rank;
  std::vector<std::shared_ptr<Channel>> evicted;  // destroyed outside the lock
  {
    absl::MutexLock lock(&state_->mu);
    // Full: close the oldest channels no transfer is using (workers that went away).
    // One still joining stays: closing it would wait for its join here.
    for (auto it = state_->channels.begin();
         state_->channels.size() >= kMaxChannels && it != state_->channels.end();) {
      if (it->second->joined.HasBeenNotified() && it->second->transfer_mu.try_lock()) {
        it->second->transfer_mu.unlock();
        evicted.push_back(std::move(it->second));
        it = state_->channels.erase(it);
      } else {
        ++it;
      }
    }
    if (state_->channels.size() >= kMaxChannels) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", kMaxChannels, " NCCL channels of this server are busy"));
    }
    channel->id = state_->next_id++;
    state_->channels[channel->id] = channel;
  }
  Channel* joining = channel.get();
  const int device = state_->device;
  const absl::Duration timeout = timeout_;
  joining->joiner = std::thread([joining, unique_id, device, timeout, closing = state_->closing.get_token()] {
    joining->join_status = [&]() -> absl::Status {
      FLATSHARD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      FLATSHARD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&joining->stream, cudaStreamNonBlocking));
      FLATSHARD_ASSIGN_OR_RETURN(
          joining->comm,
          kc::NcclCommunicator::Create(unique_id, 2, transport::kNcclServerRank, timeout, closing));
      return absl::OkStatus();
    }();
    joining->joined.Notify();
  });
  return channel->id;
#else
  (void)unique_id;
  (void)worker_rank;
  return Off();
#endif
}

absl::StatusOr<std::pair<std::shared_ptr<NcclPlane::Transfer>, StateStamp>> NcclPlane::Begin(
    const transport::Request& request, const transport::NcclTarget& target, const CallerGone& caller_gone) {
#if FLATSHARD_HAVE_CUDA
  if (state_ == nullptr) return Off();
  std::shared_ptr<Channel> channel = state_->Find(target.channel);
  if (channel == nullptr) {
    return absl::NotFoundError(absl::StrCat("no NCCL channel ", target.channel,
                                            " on this server (closed after a failure, or never "
                                            "opened); open a new one"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(std::shared_ptr<Group> group,
                             registry_.FindGroup(request.job, request.group));
  FLATSHARD_RETURN_IF_ERROR(group->CheckShardBytes(request.dtype, target.bytes, "NCCL"));
  const absl::Time deadline = request.Deadline();
  // The join gives up after timeout_ from Open: waiting a little longer hears its verdict.
  if (!channel->joined.WaitForNotificationWithDeadline(
          std::min(deadline, absl::Now() + timeout_ + absl::Seconds(5)))) {
    return absl::DeadlineExceededError(
        absl::StrCat("NCCL channel ", target.channel, " is still joining"));
  }
  if (!channel->join_status.ok()) {
    state_->Close(target.channel);
    return absl::Status(channel->join_status.code(),
                        absl::StrCat("NCCL channel ", target.channel,
                                     " could not join: ", channel->join_status.message()));
  }
  auto transfer = std::make_shared<Transfer>(*state_, channel, std::move(group), request);
  transfer->bytes = target.bytes;
  if (request.op == transport::DataOp::kNcclGather) {
    if (channel->staging.size() < target.bytes) {
      channel->staging = {};
      FLATSHARD_ASSIGN_OR_RETURN(channel->staging,
                                 kc::DeviceMemory::Allocate(target.bytes, "an NCCL gather's staging"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(
        transfer->staged,
        transfer->group().GatherInto(request.version, request.dtype, channel->staging.data(), deadline, caller_gone));
    const StateStamp staged = transfer->staged;
    return std::make_pair(std::move(transfer), staged);
  }
  FLATSHARD_ASSIGN_OR_RETURN(
      ReceiveSlot slot, driver_.BeginScatter(transfer->group(), request.version, request.worker_rank, request.dtype,
                                             request.Deadline(), SlotMemory::kDevice, {}, request.load_id));
  transfer->slot() = slot;
  const StateStamp state = transfer->group().state();
  return std::make_pair(std::move(transfer), state);
#else
  (void)request;
  (void)target;
  (void)caller_gone;
  return Off();
#endif
}

absl::StatusOr<StateStamp> NcclPlane::Finish(const std::shared_ptr<Transfer>& transfer,
                                              const CallerGone& caller_gone) {
#if FLATSHARD_HAVE_CUDA
  Channel& channel = transfer->channel();
  const transport::Request& request = transfer->request();
  const bool gather = request.op == transport::DataOp::kNcclGather;
  absl::Status moved = cudaSetDevice(state_->device) == cudaSuccess
                           ? absl::OkStatus()
                           : absl::InternalError("cudaSetDevice failed");
  if (moved.ok()) {
    constexpr int kWorker = transport::kNcclWorkerRank;
    moved = gather ? channel.comm->Send(channel.staging.data(), transfer->bytes, kWorker,
                                        channel.stream)
                   : channel.comm->Recv(transfer->slot()->buffer.data(), transfer->bytes, kWorker,
                                        channel.stream);
  }
  if (moved.ok()) moved = channel.comm->Wait(channel.stream, timeout_, {}, caller_gone);
  if (!moved.ok()) {
    channel.comm->Abort();
    transfer->CloseChannel();
    if (!absl::IsCancelled(moved)) ++stats_.errors;  // a worker that gave up is no error of ours
    return absl::Status(moved.code(), absl::StrCat("NCCL channel ", channel.id, " (worker ",
                                                   channel.worker_rank, "): ", moved.message(),
                                                   "; channel closed"));
  }
  stats_.bytes_sent += gather ? static_cast<int64_t>(transfer->bytes) : 0;
  stats_.bytes_received += gather ? 0 : static_cast<int64_t>(transfer->bytes);
  if (gather) {
    ++stats_.gathers;
    ++stats_.nccl_gathers;
    return transfer->staged;
  }
  const ReceiveSlot slot = *transfer->slot();
  transfer->slot().reset();  // committed below, no longer the transfer's to give back
  FLATSHARD_ASSIGN_OR_RETURN(CommitOutcome outcome, transfer->group().CommitScatter(slot));
  ++stats_.scatters;
  ++stats_.nccl_scatters;
  FLATSHARD_RETURN_IF_ERROR(driver_.Continue(transfer->group(), request.version, outcome));
  return transfer->group().state();
#else
  (void)transfer;
  (void)caller_gone;
  return Off();
#endif
}

}  // namespace flatshard::server
