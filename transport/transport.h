// The data plane's byte-moving interface: a Connection moves raw bytes between a worker
// and a server, a Listener accepts them. Implementations: TCP (transport/tcp/, always
// built); NCCL and CUDA IPC move device memory and arrive with the GPU path.
//
// A Connection is used by one sender and one receiver at a time (the request/response
// protocol in data_protocol.h is strictly alternating); Shutdown() may be called from
// any thread to unblock both. Bytes are received straight into caller memory (a small
// receive may be read ahead with what follows it: tcp/tcp_transport.h), and a server's
// answers may be held back while its peer's next request is already there (SendOrHold).
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto conn, transport::ConnectTcp("127.0.0.1", 7071, timeout));
//   FLATSHARD_RETURN_IF_ERROR(conn->Send({header_bytes, payload}));
#ifndef FLATSHARD_TRANSPORT_TRANSPORT_H_
#define FLATSHARD_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace flatshard::transport {

class Connection {
 public:
  virtual ~Connection() = default;

  // Sends the buffers in order as one stream of bytes; returns once the kernel has
  // them. Returns Unavailable if the peer is gone and DeadlineExceeded if it stops
  // reading for longer than the timeout; the Connection is then unusable.
  [[nodiscard]] virtual absl::Status Send(
      std::initializer_list<absl::Span<const std::byte>> buffers) = 0;

  // Send, or, where the peer has already sent more than this side has received (bytes
  // read ahead: its next pipelined request), a copy of the buffers held back to go out
  // with what this side sends next, so that the answers to a pipeline leave in one write
  // rather than one each. Held bytes go out with the next Send (or a SendOrHold that does
  // not hold), SendHeld, and before this side waits to read from the peer (Recv,
  // PollReadable, WaitReadable): the peer may be waiting for them before it sends more.
  // Whoever holds bytes must SendHeld before it blocks on anything else (a server's wait
  // for a version). For a connection one thread both sends and receives on (a server's);
  // implementations without read-ahead send at once.
  [[nodiscard]] virtual absl::Status SendOrHold(std::initializer_list<absl::Span<const std::byte>> buffers) {
    return Send(buffers);
  }
  // Sends the bytes SendOrHold held back, if any.
  [[nodiscard]] virtual absl::Status SendHeld() { return absl::OkStatus(); }

  // Fills `buffer` completely. Returns Unavailable if the peer closes first (naming how
  // many bytes arrived) and DeadlineExceeded if no byte arrives for the timeout.
  [[nodiscard]] virtual absl::Status Recv(absl::Span<std::byte> buffer) = 0;

  // Inactivity timeout for each later Send/Recv (absl::InfiniteDuration(): none).
  // InvalidArgument for a timeout that is not positive.
  [[nodiscard]] virtual absl::Status SetTimeout(absl::Duration timeout) = 0;

  // Unblocks a Send or Recv in progress on another thread; later calls fail.
  virtual void Shutdown() = 0;
  // Ends what this side sends (a Send in progress and later ones fail), leaving it
  // receiving: the peer reads the end of the stream (PeerClosed) and may still answer.
  // For a request to be dropped where the peer may be moving its bytes itself (into
  // this process's GPU memory): the answer, or the peer's close, says when it let go.
  virtual void CloseSend() = 0;

  // For an idle connection (no bytes expected): whether the peer has closed or reset its
  // end, so that a request sent now would fail. Does not block; reads nothing.
  virtual bool PeerClosed() = 0;
  // Polls, without sleeping, until bytes can be received (or the peer has closed) or
  // `poll_for` has passed, yielding the CPU between polls; returns whether they can. For
  // a thread that expects an answer within microseconds: one that sleeps in Recv instead
  // takes 20-50 us to wake in a VM. Reads nothing.
  virtual bool PollReadable(absl::Duration poll_for) = 0;
  // Sleeps until bytes can be received (or the peer has closed, or Shutdown was called)
  // or `timeout` has passed (absl::InfiniteDuration(): no limit); returns whether they
  // can. For a thread that waits between requests under a timeout of its own, without
  // changing the one each Send and Recv runs under. Reads nothing.
  virtual bool WaitReadable(absl::Duration timeout) = 0;

  // "127.0.0.1:41234", for logs and errors.
  virtual std::string peer() const = 0;
};

// How long Listener::Accept waits before it reports running out of descriptors or memory.
inline constexpr absl::Duration kOutOfResourcesPause = absl::Milliseconds(100);

class Listener {
 public:
  virtual ~Listener() = default;
  // Blocks until a peer connects. Returns Cancelled after Shutdown(); ResourceExhausted,
  // after a pause (kOutOfResourcesPause), when the process is out of descriptors or
  // memory for the connection, which then waits in the backlog for the next call.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<Connection>> Accept() = 0;
  // Stops accepting; unblocks Accept(). Thread-safe.
  virtual void Shutdown() = 0;
  // The bound port (useful after binding port 0).
  virtual int port() const = 0;
};

}  // namespace flatshard::transport

#endif  // FLATSHARD_TRANSPORT_TRANSPORT_H_
