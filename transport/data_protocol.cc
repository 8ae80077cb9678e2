#include "transport/data_protocol.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::transport {
namespace {

template <typename T>
absl::Span<std::byte> BytesOf(T& value) {
  return absl::MakeSpan(reinterpret_cast<std::byte*>(&value), sizeof(T));
}

absl::Span<const std::byte> BytesOf(absl::string_view text) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(text.data()), text.size());
}

absl::Status RecvString(Connection& conn, size_t bytes, std::string& out) {
  out.resize(bytes);
  return conn.Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(out.data()), bytes));
}

// The header as sent for these names and payload size; InvalidArgument for names too long.
absl::StatusOr<RequestHeader> Framed(RequestHeader header, absl::string_view job, absl::string_view group,
                                     size_t payload_bytes) {
  if (job.size() > kMaxNameBytes || group.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("job and group names are limited to ", kMaxNameBytes, " bytes"));
  }
  header.magic = kRequestMagic;
  header.job_bytes = static_cast<uint16_t>(job.size());
  header.group_bytes = static_cast<uint16_t>(group.size());
  header.payload_bytes = static_cast<int64_t>(payload_bytes);
  return header;
}

}  // namespace

std::string DataOpName(DataOp op) {
  switch (op) {
    case DataOp::kHello:
      return "hello";
    case DataOp::kGather:
      return "gather";
    case DataOp::kScatter:
      return "scatter";
    case DataOp::kPushInit:
      return "push-init";
    case DataOp::kIpcGather:
      return "ipc-gather";
    case DataOp::kIpcScatter:
      return "ipc-scatter";
    case DataOp::kNcclGather:
      return "nccl-gather";
    case DataOp::kNcclScatter:
      return "nccl-scatter";
    case DataOp::kGatherRange:
      return "gather-range";
    case DataOp::kReplicaPartial:
      return "replica-partial";
    case DataOp::kReplicaReduced:
      return "replica-reduced";
    case DataOp::kScatterPart:
      return "scatter-part";
    case DataOp::kSetHyperparams:
      return "set-hyperparams";
  }
  return absl::StrCat("op ", static_cast<int>(op));
}

absl::Time Request::Deadline() const {
  return absl::Now() + absl::Milliseconds(std::clamp<int64_t>(timeout_ms, 0, 24 * 3600 * 1000));
}

absl::Status SendRequest(Connection& conn, RequestHeader header, absl::string_view job,
                         absl::string_view group, absl::Span<const std::byte> payload,
                         absl::Span<const std::byte> payload_tail) {
  FLATSHARD_ASSIGN_OR_RETURN(header, Framed(header, job, group, payload.size() + payload_tail.size()));
  return conn.Send({BytesOf(header), BytesOf(job), BytesOf(group), payload, payload_tail});
}

absl::Status AppendRequest(std::vector<std::byte>& out, RequestHeader header, absl::string_view job,
                           absl::string_view group, absl::Span<const std::byte> payload,
                           absl::Span<const std::byte> payload_tail) {
  FLATSHARD_ASSIGN_OR_RETURN(header, Framed(header, job, group, payload.size() + payload_tail.size()));
  const std::initializer_list<absl::Span<const std::byte>> frame = {BytesOf(header), BytesOf(job), BytesOf(group),
                                                                     payload, payload_tail};
  for (const absl::Span<const std::byte> bytes : frame) out.insert(out.end(), bytes.begin(), bytes.end());
  return absl::OkStatus();
}

std::vector<ByteRange> SplitRanges(uint64_t bytes, int count) {
  count = std::clamp(count, 1, kMaxSplitParts);
  const uint64_t share = (bytes + count - 1) / count;  // rounded up: never more than count
  const uint64_t step = std::max<uint64_t>((share + 63) / 64 * 64, 64);
  std::vector<ByteRange> ranges;
  for (uint64_t offset = 0; offset < bytes; offset += step) {
    ranges.push_back({offset, std::min(step, bytes - offset)});
  }
  return ranges;
}

absl::StatusOr<Request> RecvRequest(Connection& conn) {
  RequestHeader header;
  FLATSHARD_RETURN_IF_ERROR(conn.Recv(BytesOf(header)));
  if (header.magic != kRequestMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad frame: magic 0x", absl::Hex(header.magic), " is not a flatshard request"));
  }
  if (header.op < static_cast<uint8_t>(DataOp::kHello) ||
      header.op > static_cast<uint8_t>(kLastDataOp)) {
    return absl::InvalidArgumentError(absl::StrCat("bad frame: unknown op ", header.op));
  }
  if (header.dtype > static_cast<uint8_t>(DType::kFloat16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad frame: dtype ", header.dtype, " is not float32, bfloat16 or float16"));
  }
  if (header.job_bytes > kMaxNameBytes || header.group_bytes > kMaxNameBytes) {
    return absl::InvalidArgumentError("bad frame: job or group name too long");
  }
  if ((header.flags & ~kRequestLoadKnown) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad frame: unknown flags 0x", absl::Hex(header.flags)));
  }
  if (header.payload_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad frame: payload of ", header.payload_bytes, " bytes"));
  }
  Request request;
  request.op = static_cast<DataOp>(header.op);
  request.dtype = static_cast<DType>(header.dtype);
  request.worker_rank = header.worker_rank;
  request.version = header.version;
  request.payload_bytes = header.payload_bytes;
  request.timeout_ms = header.timeout_ms;
  if ((header.flags & kRequestLoadKnown) != 0) request.load_id = header.load_id;
  // The names follow the header back to back: one read for both.
  FLATSHARD_RETURN_IF_ERROR(RecvString(conn, size_t{header.job_bytes} + header.group_bytes, request.job));
  request.group = request.job.substr(header.job_bytes);
  request.job.resize(header.job_bytes);
  return request;
}

absl::Status SendResponse(Connection& conn, const absl::Status& status, int64_t version,
                          absl::Span<const std::byte> payload, uint64_t load_id, Delivery delivery) {
  ResponseHeader header;
  header.code = static_cast<int32_t>(status.code());
  header.version = version;
  header.load_id = load_id;
  const absl::string_view message = status.message().substr(0, kMaxMessageBytes);
  header.message_bytes = static_cast<uint32_t>(message.size());
  if (!status.ok()) payload = {};
  header.payload_bytes = static_cast<int64_t>(payload.size());
  if (delivery == Delivery::kMayHold) return conn.SendOrHold({BytesOf(header), BytesOf(message), payload});
  return conn.Send({BytesOf(header), BytesOf(message), payload});
}

absl::StatusOr<Response> RecvResponse(Connection& conn, absl::Span<std::byte> payload_dest) {
  ResponseHeader header;
  FLATSHARD_RETURN_IF_ERROR(conn.Recv(BytesOf(header)));
  if (header.magic != kResponseMagic || header.message_bytes > kMaxMessageBytes ||
      header.code < 0 || header.code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::DataLossError(absl::StrCat("malformed response from ", conn.peer()));
  }
  std::string message;
  FLATSHARD_RETURN_IF_ERROR(RecvString(conn, header.message_bytes, message));
  if (header.code != 0) {
    return Response{absl::Status(static_cast<absl::StatusCode>(header.code), message), header.version, header.load_id};
  }
  if (header.payload_bytes != 0 &&
      header.payload_bytes != static_cast<int64_t>(payload_dest.size())) {
    return absl::DataLossError(absl::StrCat(conn.peer(), " sent ", header.payload_bytes,
                                            " bytes, expected ", payload_dest.size()));
  }
  if (header.payload_bytes != 0) FLATSHARD_RETURN_IF_ERROR(conn.Recv(payload_dest));
  return Response{absl::OkStatus(), header.version, header.load_id};
}

absl::StatusOr<Response> AnswerToFailedSend(Connection& conn, const absl::Status& sent) {
  // A reset arrives after the bytes sent before it: once it has failed the send, an
  // answer sent before is there in full (one cut short would wait for the rest until the
  // connection's timeout).
  if (!absl::IsUnavailable(sent) || !conn.PollReadable(absl::ZeroDuration())) return sent;
  absl::StatusOr<Response> answer = RecvResponse(conn, {});
  if (!answer.ok() || answer->status.ok()) return sent;
  return answer;
}

absl::StatusOr<std::unique_ptr<Connection>> OpenDataConnection(absl::string_view data_address,
                                                               absl::string_view session_token, absl::Duration timeout,
                                                               std::stop_token stop, const SecureLayer& secure) {
  std::string host;
  int port = 0;
  FLATSHARD_RETURN_IF_ERROR(SplitHostPort(data_address, host, port));
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<Connection> conn, ConnectTcp(host, port, timeout, stop));
  FLATSHARD_RETURN_IF_ERROR(conn->SetTimeout(timeout));
  if (secure) {
    FLATSHARD_ASSIGN_OR_RETURN(conn, secure(std::move(conn), host));
  }
  absl::StatusOr<Response> response;
  {
    Connection* const cut = conn.get();
    const std::stop_callback shut_down(stop, [cut] { cut->Shutdown(); });
    RequestHeader hello;
    hello.op = static_cast<uint8_t>(DataOp::kHello);
    const absl::Status sent = SendRequest(
        *conn, hello, "", "",
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(session_token.data()), session_token.size()));
    response = sent.ok() ? RecvResponse(*conn, {}) : absl::StatusOr<Response>(sent);
  }
  if (stop.stop_requested()) {
    return absl::CancelledError(absl::StrCat("saying hello to the data plane at ", data_address, ": stopped"));
  }
  FLATSHARD_RETURN_IF_ERROR(response.status());
  FLATSHARD_RETURN_IF_ERROR(response->status);
  return conn;
}

absl::Status DrainPayload(Connection& conn, int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot drain ", bytes, " bytes"));
  }
  std::vector<std::byte> scratch(std::min<int64_t>(bytes, 1 << 20));
  while (bytes > 0) {
    const int64_t chunk = std::min<int64_t>(bytes, static_cast<int64_t>(scratch.size()));
    FLATSHARD_RETURN_IF_ERROR(conn.Recv(absl::MakeSpan(scratch.data(), chunk)));
    bytes -= chunk;
  }
  return absl::OkStatus();
}

}  // namespace flatshard::transport
