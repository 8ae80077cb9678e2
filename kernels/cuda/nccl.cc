#include "kernels/cuda/nccl.h"

#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"

namespace flatshard::kernels::cuda {
namespace {

// The NCCL entry points flatshard uses, resolved once.
struct NcclApi {
  std::string error;  // non-empty: unusable, and why
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommFinalize) finalize = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

const NcclApi& Api() {
  static const NcclApi* api = [] {
    auto* api = new NcclApi;
    const char* configured = std::getenv("FLATSHARD_NCCL_LIBRARY");
    const std::string name = configured != nullptr && *configured ? configured : "libnccl.so.2";
    void* library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      api->error = absl::StrCat("cannot load NCCL (", name, "): ", dlerror(),
                                "; set FLATSHARD_NCCL_LIBRARY or LD_LIBRARY_PATH");
      return api;
    }
    auto resolve = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(library, symbol));
      if (fn == nullptr && api->error.empty()) api->error = absl::StrCat(name, " has no ", symbol);
    };
    resolve(api->get_version, "ncclGetVersion");
    resolve(api->get_unique_id, "ncclGetUniqueId");
    resolve(api->init_rank_config, "ncclCommInitRankConfig");
    resolve(api->get_async_error, "ncclCommGetAsyncError");
    resolve(api->finalize, "ncclCommFinalize");
    resolve(api->destroy, "ncclCommDestroy");
    resolve(api->abort, "ncclCommAbort");
    resolve(api->group_start, "ncclGroupStart");
    resolve(api->group_end, "ncclGroupEnd");
    resolve(api->send, "ncclSend");
    resolve(api->recv, "ncclRecv");
    resolve(api->error_string, "ncclGetErrorString");
    return api;
  }();
  return *api;
}

absl::StatusOr<const NcclApi*> LoadedApi() {
  const NcclApi& api = Api();
  if (!api.error.empty()) return absl::FailedPreconditionError(api.error);
  return &api;
}

absl::Status FromNccl(ncclResult_t result, const char* call) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, " failed: ", Api().error_string(result)));
}

ncclComm_t AsComm(void* comm) { return static_cast<ncclComm_t>(comm); }

}  // namespace

class NcclCommunicator::WaitEnd {
 public:
  // `peer_gone` (null: none) outlives the wait.
  WaitEnd(std::stop_token stop, const PeerGone* peer_gone) : stop_(std::move(stop)), peer_gone_(peer_gone) {}

  // Empty while the wait goes on; otherwise why it ends.
  absl::string_view Why() {
    if (stop_.stop_requested()) return "stopped while it waited";
    if (peer_gone_ == nullptr || *peer_gone_ == nullptr) return {};
    const absl::Time now = absl::Now();
    if (now < next_peer_check_) return {};
    next_peer_check_ = now + kPeerCheck;
    return (*peer_gone_)() ? "the other side gave the transfer up" : absl::string_view();
  }

 private:
  const std::stop_token stop_;
  const PeerGone* const peer_gone_;
  absl::Time next_peer_check_ = absl::Now() + kPeerCheck;  // a quick transfer costs no check
};

absl::StatusOr<std::string> NcclVersion() {
  FLATSHARD_ASSIGN_OR_RETURN(const NcclApi* api, LoadedApi());
  int version = 0;
  FLATSHARD_RETURN_IF_ERROR(FromNccl(api->get_version(&version), "ncclGetVersion"));
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return absl::StrCat(version / 10000, ".", (version / 100) % 100, ".", version % 100);
}

absl::StatusOr<std::string> NcclCommunicator::NewUniqueId() {
  FLATSHARD_ASSIGN_OR_RETURN(const NcclApi* api, LoadedApi());
  ncclUniqueId id;
  FLATSHARD_RETURN_IF_ERROR(FromNccl(api->get_unique_id(&id), "ncclGetUniqueId"));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const std::string& unique_id, int nranks, int rank, absl::Duration timeout, const std::stop_token& stop) {
  FLATSHARD_ASSIGN_OR_RETURN(const NcclApi* api, LoadedApi());
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(absl::StrCat("an NCCL unique id has ", sizeof(ncclUniqueId),
                                                   " bytes, not ", unique_id.size()));
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " outside [0, ", nranks, ")"));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init returns at once; WaitReady polls with the deadline
  ncclComm_t comm = nullptr;
  FLATSHARD_RETURN_IF_ERROR(
      FromNccl(api->init_rank_config(&comm, nranks, id, rank, &config), "ncclCommInitRankConfig"));
  std::unique_ptr<NcclCommunicator> communicator(new NcclCommunicator(comm, nranks, rank));
  WaitEnd end(stop, nullptr);
  FLATSHARD_RETURN_IF_ERROR(communicator->WaitReady(timeout, end));
  return communicator;
}

absl::Status NcclCommunicator::AbortEarly(absl::string_view why) {
  Abort();
  return absl::CancelledError(absl::StrCat("NCCL rank ", rank_, " of ", nranks_, ": ", why, "; communicator aborted"));
}

absl::Status NcclCommunicator::WaitReady(absl::Duration timeout, WaitEnd& end) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = Api().get_async_error(AsComm(comm_), &state);
    if (queried != ncclSuccess) state = queried;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      Abort();
      return FromNccl(state, "NCCL communicator");
    }
    if (const absl::string_view why = end.Why(); !why.empty()) return AbortEarly(why);
    if (absl::Now() > deadline) {
      Abort();
      return absl::DeadlineExceededError(absl::StrCat(
          "NCCL rank ", rank_, " of ", nranks_, ": the other ranks did not answer within ",
          absl::FormatDuration(timeout), "; communicator aborted"));
    }
    absl::SleepFor(absl::Microseconds(100));
  }
}

absl::Status NcclCommunicator::GroupStart() {
  return FromNccl(Api().group_start(), "ncclGroupStart");
}

absl::Status NcclCommunicator::GroupEnd() { return FromNccl(Api().group_end(), "ncclGroupEnd"); }

absl::Status NcclCommunicator::Send(const void* buffer, size_t bytes, int peer, cudaStream_t stream) {
  if (failed_) return absl::FailedPreconditionError("the NCCL communicator was aborted");
  return FromNccl(Api().send(buffer, bytes, ncclUint8, peer, AsComm(comm_), stream), "ncclSend");
}

absl::Status NcclCommunicator::Recv(void* buffer, size_t bytes, int peer, cudaStream_t stream) {
  if (failed_) return absl::FailedPreconditionError("the NCCL communicator was aborted");
  return FromNccl(Api().recv(buffer, bytes, ncclUint8, peer, AsComm(comm_), stream), "ncclRecv");
}

absl::Status NcclCommunicator::Wait(cudaStream_t stream, absl::Duration timeout, const std::stop_token& stop,
                                    const PeerGone& peer_gone) {
  if (failed_) return absl::FailedPreconditionError("the NCCL communicator was aborted");
  WaitEnd end(stop, &peer_gone);
  FLATSHARD_RETURN_IF_ERROR(WaitReady(timeout, end));  // a non-blocking group may still be in progress
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return absl::OkStatus();
    if (done != cudaErrorNotReady) {
      Abort();
      return absl::InternalError(absl::StrCat("NCCL stream failed: ", cudaGetErrorString(done)));
    }
    ncclResult_t state = ncclSuccess;
    Api().get_async_error(AsComm(comm_), &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      Abort();
      return FromNccl(state, "NCCL transfer");
    }
    if (const absl::string_view why = end.Why(); !why.empty()) return AbortEarly(why);
    if (absl::Now() > deadline) {
      Abort();
      return absl::DeadlineExceededError(absl::StrCat("NCCL transfer on rank ", rank_, " of ", nranks_,
                                                      " did not finish within ",
                                                      absl::FormatDuration(timeout),
                                                      "; communicator aborted"));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

void NcclCommunicator::Abort() {
  if (failed_) return;
  failed_ = true;
  Api().abort(AsComm(comm_));
}

NcclCommunicator::~NcclCommunicator() {
  if (failed_) return;  // aborted: already released
  // Non-blocking: finalize may still be in progress; wait for it (WaitReady aborts if it
  // fails or takes too long), then free what is left.
  const ncclResult_t finalized = Api().finalize(AsComm(comm_));
  if (finalized != ncclSuccess && finalized != ncclInProgress) {
    Abort();
    return;
  }
  WaitEnd never({}, nullptr);
  if (WaitReady(absl::Seconds(10), never).ok()) Api().destroy(AsComm(comm_));
}

}  // namespace flatshard::kernels::cuda
