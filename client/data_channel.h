// DataChannel: a worker's data connections to one server. Holds up to `connections`
// TCP connections, each driven by its own thread that takes tasks from a shared queue,
// so at most that many transfers to the server run at once. A connection that fails is
// dropped and a fresh one (with a fresh hello) is opened for the next task. When the
// server refuses the session or cannot be reached at its data address (it restarted,
// perhaps on another port), the channel opens a new session through `renew` (the
// OpenSession RPC) and says hello again.
//
// A request with a small payload can be submitted in two parts, its writer and the task
// that reads the answer: when a connection is idle, the submitting thread writes the
// request on it at once and hands only the rest to that connection's thread, so the
// request leaves without waiting for a sleeping thread to wake (20-50 us in a VM) and
// that thread wakes while the server works; it then polls the connection for the answer
// for up to kAwaitSpin before it sleeps in the read. Thread-safe.
//
//   DataChannel channel({"127.0.0.1:7071", token}, renew, 2, absl::Seconds(30));
//   channel.Submit([](absl::StatusOr<transport::Connection*> conn) { ... });
//   channel.Submit([](transport::Connection& conn) { return Write(conn); },
//                  [](absl::StatusOr<transport::Connection*> conn) { ...read the answer... });
#ifndef FLATSHARD_CLIENT_DATA_CHANNEL_H_
#define FLATSHARD_CLIENT_DATA_CHANNEL_H_

#include <deque>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/data_protocol.h"
#include "transport/transport.h"

namespace flatshard::client_internal {

// Where a worker's data connections to one server go, and the token they present.
struct DataSession {
  std::string data_address;
  std::string token;
  transport::SecureLayer secure = {};  // its data plane speaks TLS: what wraps the connections
};
// Opens a new session with the server (the OpenSession RPC); a stop asked of `stop` ends
// it.
using SessionOpener = std::function<absl::StatusOr<DataSession>(std::stop_token stop)>;

// Runs with a ready, authenticated connection, or with the error that prevented one.
// Returns false if it left the connection unusable (it is then closed).
using DataTask = std::function<bool(absl::StatusOr<transport::Connection*>)>;
// Writes a request on a ready connection; an error is what the request ends with (the
// server's refusal, when it answered before closing the connection under the write). May
// run on the submitting thread, so it must not block for long: a request whose payload
// fits the socket's buffer.
using RequestWriter = std::function<absl::Status(transport::Connection&)>;

// `write` then `task`, as one DataTask: `task` gets the error instead when `write` fails,
// and the connection is closed.
DataTask WriteThen(RequestWriter write, DataTask task);

// How a stop reaches a request under way (DataChannel::Submit).
enum class StopCut {
  // Its connection is shut down: its sends and receives fail at once, and the server
  // drops the request. For requests whose bytes this process moves itself (TCP, and
  // NCCL, whose task aborts its own NCCL operation on the stop).
  kConnection,
  // Only what it sends is ended (Connection::CloseSend): the server drops the request
  // unless it has begun to move its bytes, and the task reads its answer, or the
  // server's close, as usual. For requests whose bytes the server moves itself (into
  // or out of this process's GPU memory: CUDA IPC), so that the request ends only once
  // the server has let go of the buffer; a server that stopped answering holds it until
  // the connection's timeout.
  kSend,
};

class DataChannel {
 public:
  DataChannel(DataSession session, SessionOpener renew, int connections, absl::Duration timeout);
  ~DataChannel();  // runs the queued tasks (with Cancelled, after Cancel), then joins the threads

  // A stop asked of `stop` (from any thread) ends the request: not yet begun, its task
  // runs with Cancelled instead of a connection (nothing is written); under way, `cut`
  // says how (its connection is closed after); the connect or hello of a connection
  // opened for it ends too, and so does a session renewal for it. The task itself says
  // what a stopped request reports. Nothing costs more when `stop` cannot stop.
  void Submit(DataTask task, std::stop_token stop = {}, StopCut cut = StopCut::kConnection);
  // `write` the request, then `task` (which reads the answer) on the same connection, as
  // Submit(WriteThen(write, task)) does, except that `write` runs on this thread when a
  // connection is idle (then only `task` runs on its thread).
  void Submit(RequestWriter write, DataTask task, std::stop_token stop = {}, StopCut cut = StopCut::kConnection);
  // For its owner's destruction: the tasks not yet started, and those submitted later,
  // run with Cancelled instead of a connection, and the connections of those under way
  // (being opened included) are shut down (their sends and receives fail at once; the
  // server drops the request), so that none waits for its server's answer (a gather
  // waiting for a version) or for a server that does not answer at all.
  void Cancel();

 private:
  struct ConnectionThread;
  struct Queued {
    DataTask task;
    std::stop_token stop;
  };
  // What Run waits for on `thread`.
  bool HasWork(const ConnectionThread& thread) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(ConnectionThread& self);
  // `self` has no task running on its connection any more (Cancel leaves it alone).
  void SetIdle(ConnectionThread& self);
  // What a task gets in place of a connection once cancelled.
  static absl::Status CancelledStatus();
  // A connection that said hello with the current session, renewed once if refused; ends
  // Cancelled at once when a stop is asked of `stop` or the channel is cancelled.
  absl::StatusOr<std::unique_ptr<transport::Connection>> Open(std::stop_token stop);
  absl::StatusOr<std::unique_ptr<transport::Connection>> Hello(const DataSession& session, std::stop_token stop) const;

  const SessionOpener renew_;
  const absl::Duration timeout_;
  absl::Mutex session_mu_;
  DataSession session_ ABSL_GUARDED_BY(session_mu_);
  mutable absl::Mutex mu_;
  std::deque<Queued> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // Asked to stop by Cancel: reaches the connections being opened.
  std::stop_source cancel_;
  std::vector<std::unique_ptr<ConnectionThread>> threads_;  // fixed after construction
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_DATA_CHANNEL_H_
