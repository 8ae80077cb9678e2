#include "server/data_server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <string>
#include <system_error>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "proto/flatshard.pb.h"
#include "server/before_blocking.h"
#include "server/hyperparams.h"
#include "server/log.h"
#include "tls/tls_connection.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::server {
namespace {

using transport::Connection;
using transport::DataOp;
using transport::Delivery;
using transport::Request;

// The part of a hybrid job's exchange that `op` carries, if any.
std::optional<Exchange> ExchangeOf(DataOp op) {
  if (op == DataOp::kReplicaPartial) return Exchange::kPartial;
  if (op == DataOp::kReplicaReduced) return Exchange::kReduced;
  return std::nullopt;
}

template <typename T>
absl::Span<std::byte> BytesOf(T& value) {
  return absl::MakeSpan(reinterpret_cast<std::byte*>(&value), sizeof(T));
}

}  // namespace

DataServer::DataServer(Registry& registry, StepDriver& driver, IpcPlane& ipc, NcclPlane& nccl,
                       const SessionTokens& sessions, ServerStats& stats, DataServerOptions options)
    : registry_(registry),
      driver_(driver),
      ipc_(ipc),
      nccl_(nccl),
      sessions_(sessions),
      stats_(stats),
      options_(options) {
  for (size_t op = static_cast<size_t>(DataOp::kHello); op < op_latency_.size(); ++op) {
    op_latency_[op] = &stats_.data_requests.For(transport::DataOpName(static_cast<DataOp>(op)));
  }
}

DataServer::~DataServer() { Stop(); }

absl::Status DataServer::Start(const std::string& host, int port) {
  FLATSHARD_ASSIGN_OR_RETURN(listener_, transport::ListenTcp(host, port));
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

int DataServer::port() const { return listener_ ? listener_->port() : 0; }

void DataServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [id, conn] : connections_) conn->Shutdown();
  }
  if (listener_) listener_->Shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::map<uint64_t, Connection*>* conns) { return conns->empty(); }, &connections_));
}

void DataServer::AcceptLoop() {
  while (true) {
    absl::StatusOr<std::unique_ptr<Connection>> conn = listener_->Accept();
    if (!conn.ok()) {
      if (absl::IsCancelled(conn.status())) return;
      continue;  // transient (e.g. out of fds, after Accept's pause): keep serving
    }
    if (options_.secure) {  // no I/O: the handshake comes with the hello, in the connection's thread
      conn = options_.secure(*std::move(conn));
      if (!conn.ok()) {
        CountError(nullptr, conn.status());
        continue;
      }
    }
    absl::Status evicted, unserved;  // counted (and logged) once the lock is released
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      if (static_cast<int>(awaiting_hello_.size()) >= options_.max_hellos) {
        // Its thread sees its Recv fail and ends; a client's hello would have come by now.
        connections_.at(*awaiting_hello_.begin())->Shutdown();
        awaiting_hello_.erase(awaiting_hello_.begin());
        evicted = absl::ResourceExhaustedError(absl::StrCat(
            options_.max_hellos, " connections were waiting for their hello (--max_data_hellos): the longest waiting "
            "closed"));
      }
      const uint64_t id = next_id_++;
      connections_[id] = conn->get();
      awaiting_hello_.insert(id);
      try {
        std::thread([this, id, c = std::move(*conn)]() mutable { ServeConnection(id, std::move(c)); }).detach();
      } catch (const std::system_error& error) {  // out of threads: the connection (moved in) is closed
        connections_.erase(id);
        awaiting_hello_.erase(id);
        unserved = absl::ResourceExhaustedError(absl::StrCat("no thread to serve a connection: ", error.what()));
      }
    }
    for (const absl::Status& refused : {evicted, unserved}) {
      if (!refused.ok()) CountError(nullptr, refused);
    }
  }
}

void DataServer::ServeConnection(uint64_t id, std::unique_ptr<Connection> conn) {
  ++stats_.open_data_connections;
  const bool authenticated = Authenticate(*conn, id);
  (void)LeaveHelloWait(id);  // refused: it waits no more either
  // Every read and write of a request runs under io_timeout; the silence between two
  // requests may last idle_timeout (a wait of its own: not two timeouts set per request).
  if (authenticated && conn->SetTimeout(options_.io_timeout).ok()) {
    // Answers held back while the next request is read ahead (transport::Delivery) go
    // out before any wait a request makes here (server/before_blocking.h), and at the end.
    const BlockingHook send_held([&conn] { (void)conn->SendHeld(); });
    absl::Cleanup last_answers = [&conn] { (void)conn->SendHeld(); };
    while (conn->WaitReadable(options_.idle_timeout)) {
      absl::StatusOr<Request> request = transport::RecvRequest(*conn);
      if (!request.ok()) {
        if (absl::IsInvalidArgument(request.status())) {
          CountError(nullptr, request.status());
          (void)transport::SendResponse(*conn, request.status(), 0, {});
        }
        break;  // garbage or a closed peer: the stream cannot be trusted any more
      }
      const LatencyClock::time_point start = LatencyClock::now();
      ++stats_.data_requests_in_flight;
      const bool serving = ServeRequest(*conn, *request);
      --stats_.data_requests_in_flight;
      op_latency_[static_cast<size_t>(request->op)]->RecordSince(start);  // RecvRequest took only known ops
      if (!serving) break;
    }
  }
  --stats_.open_data_connections;
  absl::MutexLock lock(&mu_);
  connections_.erase(id);
  conn.reset();  // close the socket before Stop() may return
}

bool DataServer::LeaveHelloWait(uint64_t id) {
  absl::MutexLock lock(&mu_);
  return awaiting_hello_.erase(id) == 1;
}

bool DataServer::Authenticate(Connection& conn, uint64_t id) {
  if (!conn.SetTimeout(options_.hello_timeout).ok()) return false;
  absl::StatusOr<Request> hello = transport::RecvRequest(conn);
  if (!hello.ok()) {  // silent or garbage peer; one refused by TLS is an operator's concern (another CA, say)
    if (tls::IsHandshakeFailure(hello.status())) {
      CountError(nullptr, absl::UnauthenticatedError(hello.status().message()));
    }
    return false;
  }
  if (hello->op != DataOp::kHello || hello->payload_bytes > transport::kMaxTokenBytes) {
    const absl::Status refused = absl::UnauthenticatedError("the first request must be a hello with a session token");
    CountError(nullptr, refused);
    (void)transport::SendResponse(conn, refused, 0, {});
    return false;
  }
  std::string token(static_cast<size_t>(hello->payload_bytes), '\0');
  if (!conn.Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(token.data()), token.size())).ok()) {
    return false;
  }
  if (!sessions_.Valid(token)) {
    const absl::Status refused = absl::UnauthenticatedError("invalid data-plane session token; call OpenSession");
    CountError(nullptr, refused);
    (void)transport::SendResponse(conn, refused, 0, {});
    return false;
  }
  // Closed meanwhile as the longest waiting (a race a flood alone makes): it is not told to go on.
  if (!LeaveHelloWait(id)) return false;
  return transport::SendResponse(conn, absl::OkStatus(), 0, {}).ok();
}

bool DataServer::ServeRequest(Connection& conn, const Request& request) {
  switch (request.op) {
    case DataOp::kGather:
    case DataOp::kGatherRange:
      return ServeGather(conn, request);
    case DataOp::kScatter:
    case DataOp::kScatterPart:
    case DataOp::kPushInit:
    case DataOp::kReplicaPartial:
    case DataOp::kReplicaReduced:
      return ServeReceive(conn, request);
    case DataOp::kIpcGather:
    case DataOp::kIpcScatter:
      // The GPU's copies and NCCL's transfers take their time, and an NCCL one waits for
      // the worker: nothing is held back across them.
      return conn.SendHeld().ok() && ServeIpc(conn, request);
    case DataOp::kNcclGather:
    case DataOp::kNcclScatter:
      return conn.SendHeld().ok() && ServeNccl(conn, request);
    case DataOp::kSetHyperparams:
      return ServeSetHyperparams(conn, request);
    case DataOp::kHello:
      return Refuse(conn, request,
                    absl::FailedPreconditionError("this connection is already authenticated"));
  }
  return false;
}

void DataServer::CountError(const Request* request, const absl::Status& status) {
  ++stats_.errors;
  const spdlog::level::level_enum level = WorthAWarning(status.code()) ? spdlog::level::warn : spdlog::level::debug;
  std::optional<int64_t> held_back = 0;
  if (level == spdlog::level::warn) {
    held_back = stats_.warnings.Admit(absl::StrCat(request == nullptr ? "connection" : transport::DataOpName(request->op),
                                             " ", absl::StatusCodeToString(status.code())));
  }
  if (!held_back.has_value() || !spdlog::should_log(level)) return;
  if (request == nullptr) {
    spdlog::log(level, "data plane: {}{}", status.ToString(), LogThrottle::HeldBack(*held_back));
  } else if (request->group.empty()) {  // a request about several groups, which its status names
    spdlog::log(level, "data plane: {} of job '{}' by worker {}: {}{}", transport::DataOpName(request->op),
                request->job, request->worker_rank, status.ToString(), LogThrottle::HeldBack(*held_back));
  } else {
    spdlog::log(level, "data plane: {} of group '{}/{}' by worker {} at version {}: {}{}",
                transport::DataOpName(request->op), request->job, request->group, request->worker_rank,
                request->version, status.ToString(), LogThrottle::HeldBack(*held_back));
  }
}

bool DataServer::Refuse(Connection& conn, const Request& request, const absl::Status& status) {
  CountError(&request, status);
  if (request.payload_bytes > options_.max_drain_bytes) {
    (void)transport::SendResponse(conn, status, 0, {});
    return false;
  }
  if (!transport::DrainPayload(conn, request.payload_bytes).ok()) return false;
  return transport::SendResponse(conn, status, 0, {}, 0, Delivery::kMayHold).ok();
}

bool DataServer::ServeGather(Connection& conn, const Request& request) {
  // A whole shard, or the range a kGatherRange names.
  const bool ranged = request.op == DataOp::kGatherRange;
  transport::ByteRange range;
  if (!ranged && request.payload_bytes != 0) {
    return Refuse(conn, request, absl::InvalidArgumentError("a gather request carries no payload"));
  }
  if (ranged) {
    if (std::optional<bool> done = RecvTarget(conn, request, BytesOf(range), "a gather range request")) {
      return *done;
    }
  }
  // The payload (if any) has been read: a refusal is the answer alone.
  auto refuse = [&](const absl::Status& status) {
    CountError(&request, status);
    return transport::SendResponse(conn, status, 0, {}, 0, Delivery::kMayHold).ok();
  };
  absl::StatusOr<std::shared_ptr<Group>> group = registry_.FindGroup(request.job, request.group);
  if (!group.ok()) return refuse(group.status());
  // A client closes (or shuts down) its end only once it has given up on the answer
  // (cancelled, destroyed): the gather stops waiting for a version then.
  absl::StatusOr<GatherSnapshot> snapshot =
      (*group)->Gather(request.version, request.dtype, request.Deadline(), [&conn] { return conn.PeerClosed(); });
  if (absl::IsCancelled(snapshot.status())) return false;  // its caller went away: nobody to answer
  if (!snapshot.ok()) return refuse(snapshot.status());
  absl::Span<const std::byte> bytes = absl::MakeConstSpan(snapshot->bytes->bytes());
  if (ranged) {
    const uint64_t size = bytes.size(), element = DTypeSize(request.dtype);
    if (range.bytes == 0 || range.offset % element != 0 || range.bytes % element != 0 ||
        range.offset > size || range.bytes > size - range.offset) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
          "gather range [", range.offset, ", +", range.bytes, ") of group '", request.group,
          "' is not a non-empty range of whole ", DTypeName(request.dtype), " elements within its ",
          size, "-byte shard")));
    }
    bytes = bytes.subspan(range.offset, range.bytes);
  }
  // Counted before the bytes go out, so that a client holding them sees them counted;
  // taken back if they do not go out. A split gather counts once.
  const int64_t gathers = !ranged || range.offset == 0 ? 1 : 0;
  stats_.gathers += gathers;
  stats_.bytes_sent += static_cast<int64_t>(bytes.size());
  const StateStamp& state = snapshot->state;
  if (transport::SendResponse(conn, absl::OkStatus(), state.version, bytes, state.load_id, Delivery::kMayHold).ok()) {
    return true;
  }
  stats_.gathers -= gathers;
  stats_.bytes_sent -= static_cast<int64_t>(bytes.size());
  return false;
}

bool DataServer::ServeReceive(Connection& conn, const Request& received) {
  // A part of a scatter or a message of the exchange: its head first; `request` then
  // counts the bytes after it.
  Request request = received;
  const std::optional<Exchange> exchange = ExchangeOf(request.op);
  const char* what = request.op == DataOp::kScatter          ? "scatter"
                     : request.op == DataOp::kScatterPart    ? "scatter part"
                     : request.op == DataOp::kReplicaPartial ? "replica partial"
                     : request.op == DataOp::kReplicaReduced ? "reduced chunk"
                                                             : "init";
  SlotPart part;
  if (request.op == DataOp::kScatterPart) {
    transport::ScatterPart head;
    if (std::optional<bool> done = RecvHead(conn, request, BytesOf(head), what)) return *done;
    // Clamped into int range; values past the limit stay out of it, and PartRange refuses them.
    part = {static_cast<int>(std::min<uint32_t>(head.index, transport::kMaxSplitParts)),
            static_cast<int>(std::min<uint32_t>(head.count, transport::kMaxSplitParts + 1))};
  } else if (exchange.has_value() && !request.load_id.has_value()) {
    return Refuse(conn, request,
                  absl::InvalidArgumentError(absl::StrCat("a ", what, " names the checkpoint load of its round")));
  }
  const bool scatter = request.op == DataOp::kScatter || request.op == DataOp::kScatterPart;
  absl::StatusOr<std::shared_ptr<Group>> group = registry_.FindGroup(request.job, request.group);
  if (!group.ok()) return Refuse(conn, request, group.status());
  // An exchange message carries one chunk of the shard (a sender outside the job's
  // replica groups is refused by BeginExchange below).
  int64_t numel = (*group)->shard_numel();
  const int sender = request.worker_rank;
  if (exchange.has_value() && (*group)->placement().replicas > 1 && sender >= 0 &&
      sender < (*group)->placement().replicas) {
    numel = (*group)->ExchangeChunk(*exchange, sender).second;
  }
  int64_t expected = numel * static_cast<int64_t>(DTypeSize(request.dtype));
  if (request.op == DataOp::kScatterPart) {
    absl::StatusOr<std::pair<size_t, size_t>> range = (*group)->PartRange(request.dtype, part);
    if (!range.ok()) return Refuse(conn, request, range.status());
    expected = static_cast<int64_t>(range->second);
  }
  if (request.payload_bytes != expected) {
    return Refuse(conn, request,
                  absl::InvalidArgumentError(absl::StrCat(
                      what, " to group '", request.group, "' carries ", request.payload_bytes,
                      " bytes; expected ", expected,
                      request.op == DataOp::kScatterPart
                          ? absl::StrCat(" (part ", part.index, " of ", part.count, " of ", numel, " ",
                                         DTypeName(request.dtype), " elements)")
                          : absl::StrCat(" (", numel, " ", DTypeName(request.dtype),
                                         exchange.has_value() ? " elements of a chunk of this server's shard)"
                                                              : " elements of this server's shard)"))));
  }
  absl::StatusOr<ReceiveSlot> slot = BeginReceive(**group, request, part);
  if (!slot.ok()) return Refuse(conn, request, slot.status());
  if (!conn.Recv(slot->buffer).ok()) {
    // The peer died or stalled mid-transfer: nothing partial is kept.
    AbortReceive(**group, request, *slot);
    CountError(&request, absl::UnavailableError("the sender stopped sending mid-transfer"));
    return false;
  }
  if (!exchange.has_value()) stats_.bytes_received += request.payload_bytes;
  absl::Status committed;
  std::optional<CommitOutcome> aside;  // continued once the peer has its answer
  if (request.op == DataOp::kPushInit) {
    committed = (*group)->CommitPushInit(*slot);
  } else {
    absl::StatusOr<CommitOutcome> outcome = exchange.has_value()
                                                ? (*group)->CommitExchange(*exchange, *slot)
                                                : (*group)->CommitScatter(*slot);
    committed = outcome.status();
    // What a peer delivered counts once it is taken, as the peer counts it (StepDriver).
    if (outcome.ok() && exchange.has_value()) stats_.exchange_bytes_received += request.payload_bytes;
    if (outcome.ok() && *outcome == CommitOutcome::kBroadcast && exchange.has_value()) {
      aside = *outcome;  // sending to peers before answering this one could deadlock
    } else if (outcome.ok()) {
      committed = driver_.Continue(**group, request.version, *outcome);
    }
    if (outcome.ok() && scatter && part.index == 0) ++stats_.scatters;  // a split one once
  }
  if (!committed.ok()) CountError(&request, committed);
  const StateStamp state = (*group)->state();
  const bool answered =
      transport::SendResponse(conn, committed, state.version, {}, state.load_id, Delivery::kMayHold).ok();
  if (aside.has_value()) driver_.ContinueAside(*std::move(group), request.version, *aside);
  return answered;
}

absl::StatusOr<ReceiveSlot> DataServer::BeginReceive(Group& group, const Request& request, SlotPart part) {
  switch (request.op) {
    case DataOp::kScatter:
    case DataOp::kScatterPart:
      return driver_.BeginScatter(group, request.version, request.worker_rank, request.dtype, request.Deadline(),
                                  SlotMemory::kHost, part, request.load_id);
    case DataOp::kReplicaPartial:
    case DataOp::kReplicaReduced: {
      if (request.dtype != DType::kFloat32) {
        return absl::InvalidArgumentError(absl::StrCat("the exchange between replica groups is float32, not ",
                                                       DTypeName(request.dtype)));
      }
      return driver_.BeginExchange(group, *ExchangeOf(request.op), {request.version, *request.load_id},
                                   request.worker_rank, request.Deadline());
    }
    default:
      return group.BeginPushInit(request.dtype);
  }
}

void DataServer::AbortReceive(Group& group, const Request& request, const ReceiveSlot& slot) {
  switch (request.op) {
    case DataOp::kScatter:
    case DataOp::kScatterPart:
      return group.AbortScatter(slot);
    case DataOp::kReplicaPartial:
    case DataOp::kReplicaReduced:
      return group.AbortExchange(*ExchangeOf(request.op), slot);
    default:
      return group.AbortPushInit(slot);
  }
}

bool DataServer::ServeSetHyperparams(Connection& conn, const Request& request) {
  if (!request.group.empty()) {
    return Refuse(conn, request,
                  absl::InvalidArgumentError("a set-hyperparams request names its groups in its payload, not its "
                                             "header"));
  }
  if (request.payload_bytes > transport::kMaxSettingsBytes) {
    return Refuse(conn, request,
                  absl::InvalidArgumentError(absl::StrCat("a set-hyperparams request carries at most ",
                                                          transport::kMaxSettingsBytes, " bytes of settings; this one ",
                                                          request.payload_bytes)));
  }
  std::string payload(static_cast<size_t>(request.payload_bytes), '\0');
  if (!conn.Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(payload.data()), payload.size())).ok()) return false;
  v1::SetHyperparamsRequest settings;
  const absl::Status status =
      settings.ParseFromString(payload)
          ? SetHyperparams(registry_, request.job, settings)
          : absl::InvalidArgumentError("a set-hyperparams request's payload is not a serialized SetHyperparamsRequest");
  if (!status.ok()) CountError(&request, status);
  return transport::SendResponse(conn, status, 0, {}, 0, Delivery::kMayHold).ok();
}

std::optional<bool> DataServer::RecvHead(Connection& conn, Request& request, absl::Span<std::byte> head,
                                         absl::string_view request_name) {
  if (request.payload_bytes < static_cast<int64_t>(head.size())) {
    return Refuse(
        conn, request,
        absl::InvalidArgumentError(absl::StrCat("a ", request_name, " starts with its ", head.size(),
                                                "-byte head; this one carries ", request.payload_bytes, " bytes")));
  }
  if (!conn.Recv(head).ok()) return false;
  request.payload_bytes -= static_cast<int64_t>(head.size());
  return std::nullopt;
}

std::optional<bool> DataServer::RecvTarget(Connection& conn, const Request& request,
                                           absl::Span<std::byte> target,
                                           absl::string_view request_name) {
  if (request.payload_bytes != static_cast<int64_t>(target.size())) {
    return Refuse(conn, request,
                  absl::InvalidArgumentError(absl::StrCat(
                      request_name, " carries a ", target.size(), "-byte target; this one ",
                      request.payload_bytes, " bytes")));
  }
  if (!conn.Recv(target).ok()) return false;
  return std::nullopt;
}

bool DataServer::ServeIpc(Connection& conn, const Request& request) {
  transport::IpcTarget target;
  if (std::optional<bool> done = RecvTarget(conn, request, BytesOf(target), "a CUDA IPC request")) {
    return *done;
  }
  // A gather stops waiting for its version once the worker closes its end (as ServeGather's).
  absl::StatusOr<StateStamp> state = request.op == DataOp::kIpcGather
                                         ? ipc_.Gather(request, target, [&conn] { return conn.PeerClosed(); })
                                         : ipc_.Scatter(request, target);
  if (request.op == DataOp::kIpcGather && absl::IsCancelled(state.status())) return false;  // nobody to answer
  if (!state.ok()) CountError(&request, state.status());
  const StateStamp answered = state.value_or(StateStamp{});
  return transport::SendResponse(conn, state.status(), answered.version, {}, answered.load_id).ok();
}

bool DataServer::ServeNccl(Connection& conn, const Request& request) {
  transport::NcclTarget target;
  if (std::optional<bool> done = RecvTarget(conn, request, BytesOf(target), "an NCCL request")) {
    return *done;
  }
  auto begun = nccl_.Begin(request, target, [&conn] { return conn.PeerClosed(); });
  if (request.op == DataOp::kNcclGather && absl::IsCancelled(begun.status())) return false;  // as ServeIpc's
  if (!begun.ok()) {
    CountError(&request, begun.status());
    return transport::SendResponse(conn, begun.status(), 0, {}).ok();
  }
  auto& [transfer, ready] = *begun;
  // Dropping `transfer` unfinished gives back what Begin took (the worker never starts).
  if (!transport::SendResponse(conn, absl::OkStatus(), ready.version, {}, ready.load_id).ok()) return false;
  // A worker that closed its end gave the request up (stopped, or gone) and moves no
  // bytes for it: ours would only wait for it until the timeout, holding the channel.
  // Finish watches for that too while the bytes move (also a shutdown's).
  if (conn.PeerClosed()) return false;
  absl::StatusOr<StateStamp> done = nccl_.Finish(transfer, [&conn] { return conn.PeerClosed(); });
  const StateStamp answered = done.value_or(StateStamp{});
  return transport::SendResponse(conn, done.status(), answered.version, {}, answered.load_id).ok();
}

}  // namespace flatshard::server
