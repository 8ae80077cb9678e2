// The data-plane wire protocol, shared by the client and the server. Request/response on
// one Connection; a client may write several requests before it reads their answers (a
// pipeline), which the server reads and answers one after the other, in order:
//
//   worker -> server  Request:  RequestHeader | job | group | payload
//   server -> worker  Response: ResponseHeader | message | payload
//
// Both headers name a checkpoint load (load_id: the id a load's COMMIT installs, the
// same on every server; 0 before any load), so that nothing computed from the state a
// load replaced is taken for the loaded one, even at the same version:
//  - a gather's answer: the load its bytes come from; a gather whose parts name
//    different loads is torn (a load was committing) and the client refuses it;
//  - a scatter, with kRequestLoadKnown: the load of the parameters its gradient was
//    computed from; the server refuses one of a state it no longer holds (Aborted);
//  - an exchange message between servers: the load of the sender's round.
//
// The first request on a connection must be kHello with the session token (issued by
// the authenticated OpenSession RPC) as its payload; the server closes connections that
// do not start that way. Headers are fixed-size little-endian structs; every length is
// bounded before anything is allocated. Pure functions; thread-safe on distinct
// connections.
//
//   FLATSHARD_RETURN_IF_ERROR(SendRequest(conn, header, "default", "mlp.0", grad_bytes));
//   FLATSHARD_ASSIGN_OR_RETURN(Response response, RecvResponse(conn, absl::MakeSpan(dest)));
//   FLATSHARD_RETURN_IF_ERROR(response.status);  // the server's verdict
#ifndef FLATSHARD_TRANSPORT_DATA_PROTOCOL_H_
#define FLATSHARD_TRANSPORT_DATA_PROTOCOL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "transport/transport.h"

namespace flatshard::transport {

enum class DataOp : uint8_t {
  kHello = 1,     // payload: session token
  kGather = 2,    // version = min_version; response payload: the shard in `dtype`
  kScatter = 3,   // version = step; payload: this server's gradient slice in `dtype`
  kPushInit = 4,  // payload: this server's shard of initial values in `dtype`
  // CUDA IPC, for a worker on the GPU of a --memory=device server: the payload is an
  // IpcTarget naming the worker's device buffer, and the server's kernels move the bytes.
  kIpcGather = 5,   // version = min_version; the server writes the shard in `dtype` there
  kIpcScatter = 6,  // version = step; the server reads the gradient slice in `dtype` there
  // NCCL, for a worker GPU and a --memory=device server on another GPU or node, over the
  // communicator the OpenNcclChannel RPC set up; the payload is an NcclTarget. The server
  // answers twice: once ready (the transfer may start; an error ends the request there),
  // then done, after the bytes moved (a scatter: once it is committed).
  kNcclGather = 7,   // version = min_version; the server sends the shard in `dtype`
  kNcclScatter = 8,  // version = step; the server receives the gradient slice in `dtype`
  // Part of a gather, so that one large shard can come over several connections at once:
  // the payload is a ByteRange; the response payload is those bytes of the shard in
  // `dtype` at a version >= min_version (the ranges of one gather may see different
  // versions when the group steps meanwhile; the client checks).
  kGatherRange = 9,  // version = min_version
  // Server to server, hybrid sharding (server/group.h, "the exchange"): a replica
  // group's partial sum of the gradient for the chunk of the shard that the receiver
  // reduces. version = step, worker_rank = the sender's replica group, load_id = the
  // load of the sender's round; payload: the chunk in float32. The receiver waits
  // (timeout_ms) until it reaches that step, or commits that load.
  kReplicaPartial = 10,
  // Server to server, hybrid sharding: the sender's chunk of the shard, reduced over
  // every replica group. Fields as for kReplicaPartial.
  kReplicaReduced = 11,
  // Part of a scatter, so that one large gradient slice can go over several connections
  // at once: the payload is a ScatterPart followed by that part's bytes. The server
  // takes the contribution once every part has arrived; each part is answered like a
  // scatter (a part that completes it: after the step it triggers).
  kScatterPart = 12,  // version = step
  // New optimizer settings for groups of the request's job, from the next step on (the
  // SetHyperparams RPC's rule, server/hyperparams.h): the payload is a serialized
  // v1::SetHyperparamsRequest of at most kMaxSettingsBytes whose job is not read; the
  // name of the group is empty. On the data plane so that a learning-rate schedule's
  // change each step takes a warm connection's round trip rather than a gRPC call's
  // (bench/RESULTS.md); the client asks server 0 first, then the others.
  kSetHyperparams = 13,
};
inline constexpr DataOp kLastDataOp = DataOp::kSetHyperparams;

// "gather", "scatter", ... for logs and messages ("op 42" for a number that is none).
std::string DataOpName(DataOp op);

inline constexpr uint32_t kRequestMagic = 0x31445346;   // "FSD1"
inline constexpr uint32_t kResponseMagic = 0x31525346;  // "FSR1"
inline constexpr uint32_t kMaxNameBytes = 1024;
inline constexpr uint32_t kMaxMessageBytes = 4096;
inline constexpr uint32_t kMaxTokenBytes = 256;
inline constexpr uint32_t kMaxSettingsBytes = uint32_t{16} << 20;  // kSetHyperparams' payload, as gRPC's

// RequestHeader::flags: load_id names the state the request was computed from. Without
// it (a worker that never gathered nor pushed the group) the server does not check it.
inline constexpr uint16_t kRequestLoadKnown = 1;

#pragma pack(push, 1)
struct RequestHeader {
  uint32_t magic = kRequestMagic;
  uint8_t op = 0;
  uint8_t dtype = 0;  // flatshard::DType
  uint16_t job_bytes = 0;
  uint16_t group_bytes = 0;
  uint16_t flags = 0;  // kRequestLoadKnown; other bits must be 0
  int32_t worker_rank = 0;
  int64_t version = 0;
  int64_t payload_bytes = 0;
  int64_t timeout_ms = 0;  // how long the server may wait (gather's min_version)
  uint64_t load_id = 0;    // the checkpoint load the request's state comes from (above)
};
struct ResponseHeader {
  uint32_t magic = kResponseMagic;
  int32_t code = 0;  // absl::StatusCode
  int64_t version = 0;
  int64_t payload_bytes = 0;
  uint32_t message_bytes = 0;
  uint32_t reserved = 0;
  uint64_t load_id = 0;  // the load of the group state answered from (gathers: the bytes')
};
#pragma pack(pop)
// The payload of kIpcGather and kIpcScatter: `bytes` at `offset` of the worker's
// allocation that `handle` (cudaIpcMemHandle_t) exports.
struct IpcTarget {
  char handle[64] = {};
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
// The ranks of an NCCL channel's 2-rank communicator.
inline constexpr int kNcclServerRank = 0;
inline constexpr int kNcclWorkerRank = 1;

// The payload of kNcclGather and kNcclScatter: the channel and the bytes to move.
struct NcclTarget {
  uint64_t channel = 0;
  uint64_t bytes = 0;
};
// The payload of kGatherRange: `bytes` bytes from byte `offset` of the shard in the
// request's dtype; both multiples of the dtype's size, bytes > 0.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
// The head of kScatterPart's payload: the part is range `index` of
// SplitRanges(the whole slice's bytes, `count`), which must yield exactly `count`.
struct ScatterPart {
  uint32_t index = 0;
  uint32_t count = 0;
};
// The most parts one transfer may be split into.
inline constexpr int kMaxSplitParts = 64;
static_assert(sizeof(ByteRange) == 16);
static_assert(sizeof(ScatterPart) == 8);
static_assert(sizeof(RequestHeader) == 48);
static_assert(sizeof(NcclTarget) == 16);
static_assert(sizeof(IpcTarget) == 80);
static_assert(sizeof(ResponseHeader) == 40);

// A request whose header and names have been read and checked; the payload (if any) is
// still on the connection.
struct Request {
  DataOp op = DataOp::kHello;
  DType dtype = DType::kFloat32;
  int32_t worker_rank = 0;
  int64_t version = 0;
  int64_t payload_bytes = 0;
  int64_t timeout_ms = 0;
  std::optional<uint64_t> load_id;  // with kRequestLoadKnown
  std::string job;
  std::string group;

  // When waiting on the request's behalf must end: timeout_ms from now, at most a day.
  absl::Time Deadline() const;
};

// Sends header + names + payload, where the payload is `payload` followed by
// `payload_tail` (header.payload_bytes is set from both).
[[nodiscard]] absl::Status SendRequest(Connection& conn, RequestHeader header,
                                       absl::string_view job, absl::string_view group,
                                       absl::Span<const std::byte> payload,
                                       absl::Span<const std::byte> payload_tail = {});

// The same request appended to `out`, for requests written back to back (a pipeline:
// the server answers them in order on the connection).
[[nodiscard]] absl::Status AppendRequest(std::vector<std::byte>& out, RequestHeader header, absl::string_view job,
                                         absl::string_view group, absl::Span<const std::byte> payload,
                                         absl::Span<const std::byte> payload_tail = {});

// How a transfer of `bytes` is split into parts (kGatherRange, kScatterPart): at most
// `count` (clamped to [1, kMaxSplitParts]) consecutive, non-empty ranges covering
// [0, bytes), each a multiple of 64 bytes (whole elements of every dtype) but the last.
// Fewer than `count` when `bytes` is too small for that many. Both ends of a split
// derive the ranges from this function.
std::vector<ByteRange> SplitRanges(uint64_t bytes, int count);

// Reads and validates a request header and its names. InvalidArgument for a bad magic,
// op, dtype, flag or length (the caller should then close the connection: the stream can no
// longer be trusted); transport errors as Connection::Recv returns them.
[[nodiscard]] absl::StatusOr<Request> RecvRequest(Connection& conn);

// How SendResponse sends: at once, or through Connection::SendOrHold (an answer that
// may wait for the answers to the requests read ahead, to leave with them).
enum class Delivery { kNow, kMayHold };

// Sends `status` (its code and message), `version`, `load_id` and, when OK, `payload`.
[[nodiscard]] absl::Status SendResponse(Connection& conn, const absl::Status& status, int64_t version,
                                        absl::Span<const std::byte> payload, uint64_t load_id = 0,
                                        Delivery delivery = Delivery::kNow);

// What the server answered: its status for the request, and the version and load of the
// group state it answered from.
struct Response {
  absl::Status status;
  int64_t version = 0;
  uint64_t load_id = 0;
};

// Reads a response. On an OK response with a payload, the payload must be exactly
// `payload_dest.size()` bytes and is received straight into it. The outer status is the
// transport's (the connection is unusable after an error: Unavailable, DeadlineExceeded,
// DataLoss for a malformed response); the server's own verdict is Response::status.
[[nodiscard]] absl::StatusOr<Response> RecvResponse(Connection& conn,
                                                    absl::Span<std::byte> payload_dest);

// For a SendRequest on `conn` that failed with `sent`: the answer the peer sent before
// it closed the connection, when one is there to read now, else `sent`. A data server
// refuses a request whose payload is too large to read and drop by answering at once and
// closing, which fails the send (a reset); its answer says why. An OK answer is not a
// refusal and is not returned. The connection is unusable either way.
[[nodiscard]] absl::StatusOr<Response> AnswerToFailedSend(Connection& conn, const absl::Status& sent);

// Wraps a new TCP connection to `host` in a secure layer (TLS, tls/tls_connection.h)
// that does its handshake on the first Send or Recv, so that a timeout or Shutdown ends
// that too.
using SecureLayer = std::function<absl::StatusOr<std::unique_ptr<Connection>>(std::unique_ptr<Connection> tcp,
                                                                             const std::string& host)>;
// The same for a connection a data server accepted (no host to check).
using SecureAcceptedLayer =
    std::function<absl::StatusOr<std::unique_ptr<Connection>>(std::unique_ptr<Connection> tcp)>;

// Connects to the data plane at `data_address` ("host:port", from OpenSession), wrapped
// in `secure` unless it is empty (a server whose data plane speaks TLS), and presents
// `session_token` (kHello); every later Send/Recv times out after `timeout`. Errors:
// transport errors (a failed handshake among them), the server's refusal of the token,
// or Cancelled at once when a stop is asked of `stop` (the connect, or the handshake and
// the wait for the hello's answer, ends).
[[nodiscard]] absl::StatusOr<std::unique_ptr<Connection>> OpenDataConnection(absl::string_view data_address,
                                                                             absl::string_view session_token,
                                                                             absl::Duration timeout,
                                                                             std::stop_token stop = {},
                                                                             const SecureLayer& secure = nullptr);

// Reads and throws away `bytes` bytes (a refused request's payload), in bounded chunks.
// InvalidArgument for a negative count; transport errors as Connection::Recv returns them.
[[nodiscard]] absl::Status DrainPayload(Connection& conn, int64_t bytes);

}  // namespace flatshard::transport

#endif  // FLATSHARD_TRANSPORT_DATA_PROTOCOL_H_
