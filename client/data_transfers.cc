#include "client/data_transfers.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/device_memory.h"
#include "client/early_answer.h"
#include "client/either_stop.h"
#include "client/wait_hook.h"
#include "core/status_macros.h"
#include "flatshard/await.h"

namespace flatshard::client_internal {

DataTransfers::DataTransfers(ClientOptions options, std::vector<ServerEndpoint> servers,
                             ControlCalls calls)
    : options_(std::move(options)),
      servers_(std::move(servers)),
      calls_(std::move(calls)),
      // Loading NCCL costs; only a cluster with an NCCL plane needs it.
      nccl_loads_(std::any_of(servers_.begin(), servers_.end(),
                              [](const ServerEndpoint& server) { return server.nccl; }) &&
                  NcclLink::Available()),
      staging_pool_(&AllocateStagingHost,
                    options_.max_in_flight * static_cast<int>(servers_.size())) {
  for (int i = 0; i < num_servers(); ++i) {
    nccl_links_.push_back(std::make_unique<NcclLinks>(
        options_.max_in_flight,
        [this, i](int device, const std::stop_token& stop) { return OpenLink(i, device, stop); }));
    channels_.push_back(std::make_unique<DataChannel>(
        servers_[i].session, [this, i](std::stop_token stop) { return calls_.open_session(i, stop); },
        options_.max_in_flight, options_.timeout + absl::Seconds(5)));
  }
}

DataTransfers::~DataTransfers() {
  destroying_.request_stop();
  for (const std::unique_ptr<DataChannel>& channel : channels_) channel->Cancel();
  absl::MutexLock lock(&aside_mu_);
  aside_mu_.Await(absl::Condition(
      +[](int* running) { return *running == 0; }, &aside_running_));
}

template <typename Work>
void DataTransfers::RunAside(Work work) {
  {
    absl::MutexLock lock(&aside_mu_);
    ++aside_running_;
  }
  std::thread([this, work = std::move(work)]() mutable {
    {
      Work done = std::move(work);
      done();
    }  // what `work` held is released before the destructor may go on
    absl::MutexLock lock(&aside_mu_);
    --aside_running_;
  }).detach();
}

std::future<absl::StatusOr<int64_t>> DataTransfers::Gather(const std::string& group, int64_t min_version, DType dtype,
                                                           std::vector<absl::Span<std::byte>> parts,
                                                           std::vector<int> servers, std::stop_token stop) {
  auto done = std::make_shared<Completion<absl::StatusOr<int64_t>>>(
      static_cast<int>(servers.size()), /*same_version=*/false,
      [this, group](int64_t, uint64_t load_id) { RecordLoadHeld(group, load_id); });
  std::future<absl::StatusOr<int64_t>> gathered = done->future();
  const int device = DeviceOf(parts[servers.front()].data());
  if (device >= 0) {
    DeviceTransfer(transport::DataOp::kGather, group, min_version, dtype, std::move(parts), servers, device, stop,
                   done);
  } else {
    HostGather(group, min_version, dtype, std::move(parts), std::move(servers), std::move(stop), done);
  }
  return gathered;
}

std::future<absl::Status> DataTransfers::Scatter(const std::string& group, int64_t step, DType dtype,
                                                 std::vector<absl::Span<std::byte>> parts, std::vector<int> servers,
                                                 std::stop_token stop) {
  const int device = DeviceOf(parts[servers.front()].data());
  if (device < 0) return HostScatter(group, step, dtype, parts, servers, stop, RecordAnswer(group, step));
  auto done =
      std::make_shared<Completion<absl::Status>>(static_cast<int>(servers.size()), false, RecordAnswer(group, step));
  std::future<absl::Status> scattered = done->future();
  DeviceTransfer(transport::DataOp::kScatter, group, step, dtype, std::move(parts), servers, device, stop, done);
  return scattered;
}

bool DataTransfers::Pipelinable(const std::vector<absl::Span<std::byte>>& parts, const std::vector<int>& servers,
                                int64_t split_bytes) const {
  for (int i : servers) {
    if (parts[i].size() > kPipelinedPartBytes || DeviceOf(parts[i].data()) >= 0 ||
        SplitFor(parts[i].size(), split_bytes).size() > 1) {
      return false;
    }
  }
  return true;
}

std::vector<std::future<absl::StatusOr<int64_t>>> DataTransfers::GatherMany(const std::vector<GroupParts>& groups,
                                                                            int64_t min_version, DType dtype,
                                                                            const std::vector<int>& servers,
                                                                            const std::stop_token& stop) {
  using Result = absl::StatusOr<int64_t>;
  std::vector<std::future<Result>> gathered;
  gathered.reserve(groups.size());
  std::vector<std::vector<Piped<Result>>> piped(num_servers());
  for (const GroupParts& group : groups) {
    if (!Pipelinable(group.parts, servers, options_.gather_split_bytes)) {
      gathered.push_back(Gather(group.group, min_version, dtype, group.parts, servers, stop));
      continue;
    }
    auto done = std::make_shared<Completion<Result>>(
        static_cast<int>(servers.size()), /*same_version=*/false,
        [this, name = group.group](int64_t, uint64_t load_id) { RecordLoadHeld(name, load_id); });
    gathered.push_back(done->future());
    for (int i : servers) piped[i].push_back({done, group.group, {}, group.parts[i], {}});
  }
  for (int i : servers) SubmitPipelines(i, transport::DataOp::kGather, min_version, dtype, std::move(piped[i]), stop);
  return gathered;
}

std::vector<std::future<absl::Status>> DataTransfers::ScatterMany(const std::vector<GroupParts>& groups, int64_t step,
                                                                  DType dtype, const std::vector<int>& servers,
                                                                  const std::stop_token& stop) {
  std::vector<std::future<absl::Status>> scattered;
  scattered.reserve(groups.size());
  std::vector<std::vector<Piped<absl::Status>>> piped(num_servers());
  for (const GroupParts& group : groups) {
    if (!Pipelinable(group.parts, servers, options_.scatter_split_bytes)) {
      scattered.push_back(Scatter(group.group, step, dtype, group.parts, servers, stop));
      continue;
    }
    auto done = std::make_shared<Completion<absl::Status>>(static_cast<int>(servers.size()), false,
                                                           RecordAnswer(group.group, step));
    scattered.push_back(done->future());
    for (int i : servers) piped[i].push_back({done, group.group, group.parts[i], {}, {}});
  }
  for (int i : servers) SubmitPipelines(i, transport::DataOp::kScatter, step, dtype, std::move(piped[i]), stop);
  return scattered;
}

absl::Status DataTransfers::PushInits(const std::vector<GroupInit>& groups, std::stop_token stop) {
  size_t most_zeros = 0;
  for (const GroupInit& init : groups) {
    for (const InitShard& shard : init.shards) most_zeros = std::max(most_zeros, shard.zero_bytes);
  }
  auto zeros = std::make_shared<const std::vector<std::byte>>(most_zeros);
  std::vector<std::shared_ptr<Completion<absl::Status>>> completions;
  std::vector<std::future<absl::Status>> pushed;
  completions.reserve(groups.size());
  pushed.reserve(groups.size());
  // Small shards go in pipelines (their bytes are copied into each pipeline's frames).
  std::vector<std::vector<Piped<absl::Status>>> piped(num_servers());
  for (const GroupInit& init : groups) {
    auto completion = std::make_shared<Completion<absl::Status>>(num_servers());
    pushed.push_back(completion->future());
    const bool small = std::all_of(init.shards.begin(), init.shards.end(), [](const InitShard& shard) {
      return shard.values.size() + shard.zero_bytes <= kPipelinedPartBytes;
    });
    for (int i = 0; i < num_servers(); ++i) {
      const absl::Span<const std::byte> tail = absl::MakeConstSpan(*zeros).first(init.shards[i].zero_bytes);
      if (small) {
        piped[i].push_back({completion, init.group, init.shards[i].values, {}, tail});
      } else {
        SubmitOne(completion, i, transport::DataOp::kPushInit, init.group, 0, DType::kFloat32, init.shards[i].values,
                  tail, {}, zeros, stop);
      }
    }
    completions.push_back(std::move(completion));
  }
  for (int i = 0; i < num_servers(); ++i) {
    SubmitPipelines(i, transport::DataOp::kPushInit, 0, DType::kFloat32, std::move(piped[i]), stop);
  }
  absl::Status first;
  for (size_t g = 0; g < groups.size(); ++g) {
    const absl::Status status = GetCallingWaitHook(pushed[g]);
    // The caller holds the values the servers now do: a gradient computed from them names
    // their load, as after a gather.
    if (status.ok()) RecordLoadHeld(groups[g].group, completions[g]->load_id());
    if (first.ok()) first = status;
  }
  return first;
}

std::future<absl::Status> DataTransfers::SetHyperparams(int server, std::shared_ptr<const std::string> settings,
                                                       std::stop_token stop) {
  auto done = std::make_shared<Completion<absl::Status>>(1);
  std::future<absl::Status> answered = done->future();
  const auto bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(settings->data()), settings->size());
  SubmitOne(done, server, transport::DataOp::kSetHyperparams, /*group=*/"", 0, DType::kFloat32, bytes, {}, {},
            std::move(settings), std::move(stop));
  return answered;
}

std::vector<std::string> DataTransfers::PlaneNames() const {
  std::vector<std::string> planes(num_servers(), "tcp");
  const int device = CurrentDevice();
  if (device < 0) return planes;
  for (int i = 0; i < num_servers(); ++i) {
    const Plane plane = PlaneFor(i, device, /*exportable=*/true);
    planes[i] = plane == Plane::kCudaIpc ? "cuda-ipc" : plane == Plane::kNccl ? "nccl" : "tcp";
  }
  return planes;
}

// True when server i keeps its shards on the GPU `device` is (CUDA IPC works).
bool DataTransfers::IpcReachable(int server, int device) const {
  if (servers_[server].gpu_uuid.empty()) return false;
  absl::StatusOr<std::string> uuid = DeviceUuid(device);
  return uuid.ok() && *uuid == servers_[server].gpu_uuid;
}

// The plane a buffer on `device` uses with server i (`exportable`: CUDA IPC can share
// it); ClientOptions::device_plane says how to choose.
DataTransfers::Plane DataTransfers::PlaneFor(int server, int device, bool exportable) const {
  const bool ipc = exportable && IpcReachable(server, device);
  const bool nccl = servers_[server].nccl && nccl_loads_;
  switch (options_.device_plane) {
    case DevicePlane::kAuto:
      // NCCL refuses two ranks on one GPU: same-GPU servers use IPC or TCP.
      if (ipc) return Plane::kCudaIpc;
      return nccl && !IpcReachable(server, device) ? Plane::kNccl : Plane::kTcp;
    case DevicePlane::kCudaIpc:
      return ipc ? Plane::kCudaIpc : Plane::kTcp;
    case DevicePlane::kNccl:
      return nccl ? Plane::kNccl : Plane::kTcp;
    case DevicePlane::kTcp:
      return Plane::kTcp;
  }
  return Plane::kTcp;
}

// The ranges a transfer of `bytes` with one server comes in: all of it below
// `split_bytes` (0: never split), else up to max_in_flight of at least half that size.
std::vector<transport::ByteRange> DataTransfers::SplitFor(size_t bytes, int64_t split_bytes) const {
  if (split_bytes <= 0 || options_.max_in_flight < 2 || static_cast<int64_t>(bytes) < split_bytes) {
    return {{0, bytes}};  // one request, even for no bytes at all
  }
  const int64_t count = std::clamp<int64_t>(
      static_cast<int64_t>(bytes) / std::max<int64_t>(1, split_bytes / 2), 1, options_.max_in_flight);
  return transport::SplitRanges(bytes, static_cast<int>(count));
}

transport::RequestHeader DataTransfers::HeaderFor(transport::DataOp op, const std::string& group, int64_t version,
                                                  DType dtype) const {
  transport::RequestHeader header;
  header.op = static_cast<uint8_t>(op);
  header.dtype = static_cast<uint8_t>(dtype);
  header.worker_rank = options_.worker_rank;
  header.version = version;
  header.timeout_ms = absl::ToInt64Milliseconds(options_.timeout);
  using transport::DataOp;
  if (op == DataOp::kScatter || op == DataOp::kScatterPart || op == DataOp::kIpcScatter || op == DataOp::kNcclScatter) {
    absl::MutexLock lock(&loads_mu_);
    if (auto it = held_loads_.find(group); it != held_loads_.end()) {
      header.flags = transport::kRequestLoadKnown;
      header.load_id = it->second;
    }
  }
  return header;
}

void DataTransfers::RecordLoadHeld(const std::string& group, uint64_t load_id) {
  absl::MutexLock lock(&loads_mu_);
  held_loads_[group] = load_id;
}

std::function<void(int64_t, uint64_t)> DataTransfers::RecordAnswer(const std::string& group, int64_t step) {
  return [this, group, send = answers_.Begin(group, step)](int64_t min_version, uint64_t) {
    answers_.Answered(group, send, min_version);
  };
}

absl::Status DataTransfers::AtServer(int server, const absl::Status& status) const {
  if (destroying_.stop_requested()) {  // the failure is the cut connection's, whatever it says
    return absl::CancelledError(
        absl::StrCat("server ", servers_[server].address, ": the client was destroyed with this transfer in flight"));
  }
  return absl::Status(status.code(),
                      absl::StrCat("server ", servers_[server].address, ": ", status.message()));
}

absl::Status DataTransfers::RequestFailure(int server, const absl::Status& status, transport::DataOp op,
                                           const std::string& group, const std::stop_token& stop) const {
  if (!stop.stop_requested()) return AtServer(server, status);
  return AtServer(server, absl::CancelledError(
                              absl::StrCat("the ", transport::DataOpName(op), " of group '", group, "' was stopped")));
}

// A new NCCL link with server i on `device`: the OpenNcclChannel RPC, then the join; a
// stop asked of `stop` ends either.
absl::StatusOr<std::shared_ptr<NcclLink>> DataTransfers::OpenLink(int server, int device,
                                                                  const std::stop_token& stop) {
  auto open_channel = [&](const std::string& unique_id) { return calls_.open_nccl_channel(server, unique_id, stop); };
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<NcclLink> link,
                             NcclLink::Open(device, options_.timeout, open_channel, stop));
  return std::shared_ptr<NcclLink>(std::move(link));
}

// One request to server i: `send` then `send_tail` is its payload, `receive` its response
// payload's destination; it finishes `completion`, and `keep_alive` is held until then.
// A request of at most kWriteOnSubmitBytes leaves from this thread when a connection is
// idle. A stop asked of `stop` ends it as `cut` says (DataChannel::Submit), Cancelled.
template <typename Result>
void DataTransfers::SubmitOne(const std::shared_ptr<Completion<Result>>& completion, int i, transport::DataOp op,
                              const std::string& group, int64_t version, DType dtype, absl::Span<const std::byte> send,
                              absl::Span<const std::byte> send_tail, absl::Span<std::byte> receive,
                              std::shared_ptr<const void> keep_alive, std::stop_token stop, StopCut cut) {
  const transport::RequestHeader header = HeaderFor(op, group, version, dtype);
  RequestWriter write = [=, this](transport::Connection& conn) {
    const absl::Status sent = transport::SendRequest(conn, header, options_.job, group, send, send_tail);
    if (sent.ok()) return sent;
    // Refused at once (a payload too large for the server to read and drop): its answer.
    absl::StatusOr<transport::Response> refused = transport::AnswerToFailedSend(conn, sent);
    return refused.ok() ? refused->status : sent;
  };
  DataTask read = [=, this, hold = std::move(keep_alive)](absl::StatusOr<transport::Connection*> conn) {
    (void)hold;
    auto fail = [&](const absl::Status& status) { completion->Finish(RequestFailure(i, status, op, group, stop), 0); };
    if (!conn.ok()) {
      fail(conn.status());
      return true;
    }
    absl::StatusOr<transport::Response> response = transport::RecvResponse(**conn, receive);
    if (!response.ok()) {
      fail(response.status());
      return false;
    }
    if (!response->status.ok()) {
      fail(response->status);
    } else {
      completion->Finish(absl::OkStatus(), response->version, response->load_id);
    }
    return true;
  };
  if (send.size() + send_tail.size() <= kWriteOnSubmitBytes) {
    channels_[i]->Submit(std::move(write), std::move(read), stop, cut);
  } else {
    channels_[i]->Submit(WriteThen(std::move(write), std::move(read)), stop, cut);
  }
}

template <typename Result>
void DataTransfers::SubmitPipelines(int server, transport::DataOp op, int64_t version, DType dtype,
                                    std::vector<Piped<Result>> requests, const std::stop_token& stop) {
  for (size_t begin = 0; begin < requests.size();) {
    size_t end = begin, bytes = 0;
    for (; end < requests.size() && end - begin < kMaxPipelined; ++end) {
      const size_t more = requests[end].send.size() + requests[end].send_tail.size() + requests[end].receive.size();
      if (end > begin && bytes + more > kPipelineBytes) break;
      bytes += more;
    }
    SubmitPipeline(server, op, version, dtype,
                   std::vector<Piped<Result>>(std::make_move_iterator(requests.begin() + begin),
                                              std::make_move_iterator(requests.begin() + end)),
                   stop);
    begin = end;
  }
}

// One pipeline to server i: its requests written at once (from this thread when a
// connection is idle and they fit kWriteOnSubmitBytes), then their answers read in order.
// A failed write or read fails the requests whose answers were not read (the server
// drops those it had not answered when the connection closes).
template <typename Result>
void DataTransfers::SubmitPipeline(int i, transport::DataOp op, int64_t version, DType dtype,
                                   std::vector<Piped<Result>> requests, const std::stop_token& stop) {
  auto frames = std::make_shared<std::vector<std::byte>>();
  auto pipeline = std::make_shared<std::vector<Piped<Result>>>();
  for (Piped<Result>& request : requests) {
    const absl::Status framed = transport::AppendRequest(*frames, HeaderFor(op, request.group, version, dtype),
                                                         options_.job, request.group, request.send,
                                                         request.send_tail);
    if (!framed.ok()) {
      request.completion->Finish(AtServer(i, framed), 0);
      continue;
    }
    pipeline->push_back(std::move(request));
  }
  if (pipeline->empty()) return;
  RequestWriter write = [frames](transport::Connection& conn) { return conn.Send({*frames}); };
  DataTask read = [=, this](absl::StatusOr<transport::Connection*> conn) {
    size_t answered = 0;
    auto fail_rest = [&](const absl::Status& status) {
      for (; answered < pipeline->size(); ++answered) {
        const Piped<Result>& request = (*pipeline)[answered];
        request.completion->Finish(RequestFailure(i, status, op, request.group, stop), 0);
      }
    };
    if (!conn.ok()) {
      fail_rest(conn.status());
      return true;
    }
    for (; answered < pipeline->size(); ++answered) {
      const Piped<Result>& request = (*pipeline)[answered];
      absl::StatusOr<transport::Response> response = transport::RecvResponse(**conn, request.receive);
      if (!response.ok()) {
        fail_rest(response.status());
        return false;
      }
      if (response->status.ok()) {
        request.completion->Finish(absl::OkStatus(), response->version, response->load_id);
      } else {
        request.completion->Finish(RequestFailure(i, response->status, op, request.group, stop), 0);
      }
    }
    return true;
  };
  if (frames->size() <= kWriteOnSubmitBytes) {
    channels_[i]->Submit(std::move(write), std::move(read), stop);
  } else {
    channels_[i]->Submit(WriteThen(std::move(write), std::move(read)), stop);
  }
}

// A CUDA IPC request (`op`) to each server in `servers` on its data channel, finishing
// `completion`: `targets[i]` is server i's IpcTarget, which `keep_alive` holds until each
// has finished. The server copies into or out of the caller's GPU memory itself, so a
// stop closes only what the request sends (StopCut::kSend).
template <typename Result>
void DataTransfers::SubmitIpc(const std::shared_ptr<Completion<Result>>& completion, transport::DataOp op,
                              const std::string& group, int64_t version, DType dtype,
                              const std::vector<absl::Span<const std::byte>>& targets, const std::vector<int>& servers,
                              const std::shared_ptr<const void>& keep_alive, const std::stop_token& stop) {
  for (int i : servers) {
    SubmitOne(completion, i, op, group, version, dtype, targets[i], {}, {}, keep_alive, stop, StopCut::kSend);
  }
}

// One NCCL transfer with server i on its data connection `conn`: the request, the
// server's ready answer, the bytes, its done answer. Returns the done answer (or why
// there is none) and whether `conn` is still usable. A stop asked of `stop` aborts the
// link's join or its operation under way.
std::pair<absl::StatusOr<transport::Response>, bool> DataTransfers::NcclTransfer(
    int server, transport::Connection& conn, transport::DataOp op, const std::string& group, int64_t version,
    DType dtype, absl::Span<std::byte> part, int device, const std::stop_token& stop) {
  const bool gather = op == transport::DataOp::kGather;
  for (int attempt = 0;; ++attempt) {
    // This transfer's own link: others with this server run beside it on theirs.
    absl::StatusOr<NcclLinks::Lease> lease = nccl_links_[server]->Acquire(device, stop);
    if (!lease.ok()) return {lease.status(), true};
    NcclLink& link = **lease;
    const transport::RequestHeader header =
        HeaderFor(gather ? transport::DataOp::kNcclGather : transport::DataOp::kNcclScatter, group, version, dtype);
    const transport::NcclTarget target{link.channel(), part.size()};
    // Until the ready answer is read, the request may have reached the server, which then
    // moves its bytes on the link: one given up in between is abandoned, not reused.
    absl::Status sent = transport::SendRequest(
        conn, header, options_.job, group,
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), sizeof(target)));
    absl::StatusOr<transport::Response> ready = sent.ok() ? transport::RecvResponse(conn, {}) : sent;
    if (!ready.ok()) {
      link.Abandon();
      return {ready.status(), false};
    }
    if (absl::IsNotFound(ready->status) && attempt == 0) {
      lease->Drop();  // the server closed the channel after a failure: reopen
      continue;
    }
    if (!ready->status.ok()) return {ready->status, true};
    // A server whose half failed, or that went away, answers or closes before ours is
    // done: that ends ours (which would wait for it until the timeout), and says why.
    EarlyAnswer done(conn);
    const std::function<bool()> server_failed = [&done] { return done.Failed(); };
    absl::Status moved = gather ? link.Recv(part.data(), part.size(), options_.timeout, stop, server_failed)
                                : link.Send(part.data(), part.size(), options_.timeout, stop, server_failed);
    // Ours failed first: the server answers done with its own error, not worth waiting for.
    if (!moved.ok() && !done.has_answer()) return {moved, false};
    absl::StatusOr<transport::Response> answer = done.Take();
    if (!answer.ok()) return {answer.status(), false};
    if (!answer->status.ok()) return {answer->status, true};
    if (!moved.ok()) return {moved, false};
    return {*answer, true};
  }
}

// NCCL transfers with `servers`, each on its data channel, finishing `completion`. The
// bytes move between this process's NCCL and the server's, never through the server's
// hands into this buffer, so a stop, or the destruction, ends a request at once: its
// connection is shut down (StopCut::kConnection; the server drops a request waiting for
// its version) and its NCCL join or operation is aborted, after which NCCL no longer
// touches the buffer. One stopped before it begins opens no NCCL link.
template <typename Result>
void DataTransfers::SubmitNccl(const std::shared_ptr<Completion<Result>>& completion, transport::DataOp op,
                               const std::string& group, int64_t version, DType dtype,
                               const std::vector<absl::Span<std::byte>>& parts, const std::vector<int>& servers,
                               int device, const std::stop_token& stop) {
  for (int i : servers) {
    const absl::Span<std::byte> part = parts[i];
    channels_[i]->Submit(
        [=, this](absl::StatusOr<transport::Connection*> conn) {
          if (!conn.ok() || stop.stop_requested()) {
            completion->Finish(RequestFailure(i, conn.status(), op, group, stop), 0);
            return true;
          }
          const EitherStop stopped_or_destroyed(stop, destroying_.get_token());
          auto [result, usable] =
              NcclTransfer(i, **conn, op, group, version, dtype, part, device, stopped_or_destroyed.token());
          const transport::Response answer = result.value_or(transport::Response{});
          completion->Finish(result.ok() ? absl::OkStatus() : RequestFailure(i, result.status(), op, group, stop),
                             answer.version, answer.load_id);
          return usable;
        },
        stop);
  }
}

// The TCP data plane for device buffers: through host copies of the slices of `servers`,
// which then go as host buffers do (HostGather, HostScatter: in parts when large). A
// gather answers the lowest version it got and the load its parts came from.
transport::Response DataTransfers::StagedTransfer(transport::DataOp op, const std::string& group, int64_t version,
                                                  DType dtype, const std::vector<absl::Span<std::byte>>& parts,
                                                  const std::vector<int>& servers, const std::stop_token& stop) {
  const bool gather = op == transport::DataOp::kGather;
  std::vector<StagingBuffer> staging(num_servers());
  // Every request has finished on every return path below: the buffers go back then.
  absl::Cleanup give_back = [&] {
    for (StagingBuffer& buffer : staging) {
      if (buffer.data() != nullptr) staging_pool_.Give(std::move(buffer));
    }
  };
  auto failed = [](const absl::Status& status) { return transport::Response{status}; };
  std::vector<absl::Span<std::byte>> staged(num_servers());
  for (int i : servers) {
    absl::StatusOr<StagingBuffer> taken = staging_pool_.Take(parts[i].size());
    if (!taken.ok()) return failed(taken.status());
    staging[i] = *std::move(taken);
    staged[i] = staging[i].bytes().subspan(0, parts[i].size());
    if (!gather) {
      if (absl::Status copied = CopyToHost(staged[i].data(), parts[i].data(), parts[i].size()); !copied.ok()) {
        return failed(copied);
      }
    }
  }
  // Await, here and below: the caller is waiting for this thread, which should see the
  // host transfer end without waiting to be woken itself.
  if (!gather) return failed(Await(HostScatter(group, version, dtype, staged, servers, stop, nullptr)));
  auto gathered = std::make_shared<Completion<absl::StatusOr<int64_t>>>(static_cast<int>(servers.size()));
  std::future<absl::StatusOr<int64_t>> min_version = gathered->future();
  HostGather(group, version, dtype, staged, servers, stop, gathered);
  absl::StatusOr<int64_t> result = Await(min_version);
  if (!result.ok()) return failed(result.status());
  for (int i : servers) {
    if (absl::Status copied = CopyToDevice(parts[i].data(), staged[i].data(), parts[i].size()); !copied.ok()) {
      return failed(copied);
    }
  }
  return transport::Response{absl::OkStatus(), *result, gathered->load_id()};
}

// Gather into / scatter from a device buffer (`parts` are its per-server slices), each
// server over the plane PlaneFor picks: CUDA IPC and NCCL move the bytes GPU to GPU
// straight from the data channels, TCP through host copies on a thread of its own.
template <typename Result>
void DataTransfers::DeviceTransfer(transport::DataOp op, const std::string& group, int64_t version, DType dtype,
                                   std::vector<absl::Span<std::byte>> parts, const std::vector<int>& servers,
                                   int device, const std::stop_token& stop,
                                   const std::shared_ptr<Completion<Result>>& done) {
  const std::byte* base = parts[servers.front()].data();
  absl::StatusOr<IpcExport> exported = ExportForIpc(base);
  std::vector<int> ipc_servers, nccl_servers, tcp_servers;
  for (int i : servers) {
    switch (PlaneFor(i, device, exported.ok())) {
      case Plane::kCudaIpc:
        ipc_servers.push_back(i);
        break;
      case Plane::kNccl:
        nccl_servers.push_back(i);
        break;
      case Plane::kTcp:
        tcp_servers.push_back(i);
        break;
    }
  }
  auto targets = std::make_shared<std::vector<transport::IpcTarget>>(num_servers());
  std::vector<absl::Span<const std::byte>> target_bytes(num_servers());
  for (int i : ipc_servers) {
    transport::IpcTarget& target = (*targets)[i];
    std::memcpy(target.handle, exported->handle.data(),
                std::min(exported->handle.size(), sizeof(target.handle)));
    target.offset = exported->offset + static_cast<uint64_t>(parts[i].data() - base);
    target.bytes = parts[i].size();
    target_bytes[i] =
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), sizeof(target));
  }
  const transport::DataOp ipc_op = op == transport::DataOp::kGather
                                       ? transport::DataOp::kIpcGather
                                       : transport::DataOp::kIpcScatter;
  // The IPC targets must outlive the requests, which finish `done`.
  SubmitIpc(done, ipc_op, group, version, dtype, target_bytes, ipc_servers, targets, stop);
  SubmitNccl(done, op, group, version, dtype, parts, nccl_servers, device, stop);
  if (tcp_servers.empty()) return;
  RunAside([=, this, parts = std::move(parts)] {
    UseDevice(device);  // the staging copies' device, on this new thread
    const transport::Response staged = StagedTransfer(op, group, version, dtype, parts, tcp_servers, stop);
    for (size_t k = 0; k < tcp_servers.size(); ++k) done->Finish(staged.status, staged.version, staged.load_id);
  });
}

// A gather into host memory. A server's part of gather_split_bytes or more comes in
// ranges over several of its connections at once; if the group stepped or was loaded
// between them (that server's ranges saw different versions or loads), that part is
// gathered again whole. As for any gather, different servers' parts may hold different
// versions (async jobs); `done` completes with the lowest.
void DataTransfers::HostGather(const std::string& group, int64_t min_version, DType dtype,
                               std::vector<absl::Span<std::byte>> parts, std::vector<int> servers, std::stop_token stop,
                               const std::shared_ptr<Completion<absl::StatusOr<int64_t>>>& done) {
  using Result = absl::StatusOr<int64_t>;
  struct SplitPart {
    int server = 0;
    std::shared_ptr<Completion<Result>> ranges;
    std::future<Result> gathered;
  };
  std::vector<SplitPart> split;
  for (int i : servers) {
    auto ranges = std::make_shared<const std::vector<transport::ByteRange>>(
        SplitFor(parts[i].size(), options_.gather_split_bytes));
    const int count = static_cast<int>(ranges->size());
    if (count == 1) {
      SubmitOne(done, i, transport::DataOp::kGather, group, min_version, dtype, {}, {}, parts[i], nullptr, stop);
      continue;
    }
    auto completion = std::make_shared<Completion<Result>>(count, /*same_version=*/true);
    split.push_back({i, completion, completion->future()});
    for (const transport::ByteRange& range : *ranges) {
      SubmitOne(completion, i, transport::DataOp::kGatherRange, group, min_version, dtype,
                absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&range), sizeof(range)), {},
                parts[i].subspan(range.offset, range.bytes), ranges, stop);
    }
  }
  if (split.empty()) return;
  RunAside([this, group, min_version, dtype, parts = std::move(parts), split = std::move(split), stop = std::move(stop),
            done]() mutable {
    // Every part is waited for, even after an error: its requests write into `parts`.
    for (SplitPart& part : split) {
      Result gathered = part.gathered.get();
      std::shared_ptr<Completion<Result>> answered = part.ranges;
      if (!gathered.ok() && gathered.status().message() == kTornGather) {
        answered = std::make_shared<Completion<Result>>(1);
        std::future<Result> whole = answered->future();
        SubmitOne(answered, part.server, transport::DataOp::kGather, group, min_version, dtype, {}, {},
                  parts[part.server], nullptr, stop);
        gathered = whole.get();
      }
      done->Finish(gathered.status(), gathered.value_or(0), answered->load_id());
    }
  });
}

// A scatter from host memory. A server's part of scatter_split_bytes or more goes in
// parts over several of its connections at once; the server takes the contribution
// when the last part has arrived.
std::future<absl::Status> DataTransfers::HostScatter(const std::string& group, int64_t step, DType dtype,
                                                     const std::vector<absl::Span<std::byte>>& parts,
                                                     const std::vector<int>& servers, const std::stop_token& stop,
                                                     std::function<void(int64_t, uint64_t)> on_ok) {
  std::vector<std::vector<transport::ByteRange>> ranges(num_servers());
  int requests = 0;
  for (int i : servers) {
    ranges[i] = SplitFor(parts[i].size(), options_.scatter_split_bytes);
    requests += static_cast<int>(ranges[i].size());
  }
  auto completion = std::make_shared<Completion<absl::Status>>(requests, false, std::move(on_ok));
  for (int i : servers) {
    const absl::Span<const std::byte> part = parts[i];
    const uint32_t count = static_cast<uint32_t>(ranges[i].size());
    if (count == 1) {
      SubmitOne(completion, i, transport::DataOp::kScatter, group, step, dtype, part, {}, {}, nullptr, stop);
      continue;
    }
    for (uint32_t k = 0; k < count; ++k) {
      auto head = std::make_shared<const transport::ScatterPart>(transport::ScatterPart{k, count});
      SubmitOne(completion, i, transport::DataOp::kScatterPart, group, step, dtype,
                absl::MakeConstSpan(reinterpret_cast<const std::byte*>(head.get()), sizeof(*head)),
                part.subspan(ranges[i][k].offset, ranges[i][k].bytes), {}, head, stop);
    }
  }
  return completion->future();
}

}  // namespace flatshard::client_internal
