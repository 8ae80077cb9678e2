// Internal to the client: EarlyAnswer, a server's answer that may come while this process
// still waits for its own part of a transfer. On the NCCL plane a worker waits for its
// NCCL half, then reads the server's done answer. A server whose half failed (its NCCL
// timed out or erred) answers with its error first, and one that went away (it is
// shutting down, its process died) closes the connection first; either way the worker's
// NCCL would wait for a peer that is not coming, until the client's timeout. Asked while
// the worker waits, EarlyAnswer reads an answer as soon as one is there and says whether
// it ends the transfer.
//
//   EarlyAnswer done(conn);
//   absl::Status moved = link.Recv(dst, bytes, timeout, stop, [&done] { return done.Failed(); });
//   absl::StatusOr<transport::Response> answer = done.Take();  // read now if it had not come
//
// Used by one thread at a time (the transfer's); `conn` outlives it.
#ifndef FLATSHARD_CLIENT_EARLY_ANSWER_H_
#define FLATSHARD_CLIENT_EARLY_ANSWER_H_

#include <optional>

#include "absl/status/statusor.h"
#include "transport/data_protocol.h"
#include "transport/transport.h"

namespace flatshard::client_internal {

class EarlyAnswer {
 public:
  explicit EarlyAnswer(transport::Connection& conn) : conn_(conn) {}

  // Reads the answer if it has begun to arrive (nothing blocks when it has not) and says
  // whether it ends the transfer: the server's error, or the connection's (closed, reset,
  // malformed). An OK answer ends nothing (the worker's half is about to finish), and
  // once read, the answer is not looked for again.
  bool Failed();
  // Whether the answer has been read.
  bool has_answer() const { return answer_.has_value(); }
  // The answer: the one read early, or read now (blocking, up to the connection's
  // timeout). Once.
  absl::StatusOr<transport::Response> Take();

 private:
  transport::Connection& conn_;
  std::optional<absl::StatusOr<transport::Response>> answer_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_EARLY_ANSWER_H_
