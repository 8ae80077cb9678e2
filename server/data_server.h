// DataServer: the server side of the TCP data plane. Accepts connections (wrapped in
// TLS with DataServerOptions::secure: the handshake, then the hello), requires a kHello
// with a valid session token first (within hello_timeout, or the connection is closed),
// then serves gather (whole shards or byte ranges of them), scatter (whole or in parts)
// and init requests, a worker's new optimizer settings (server/hyperparams.h), and the
// partial and reduced chunks that peer servers of a hybrid-sharded job exchange
// (transport/data_protocol.h; server/step_driver.h; a broadcast that a partial
// completes is continued aside once the peer has its answer) against the Registry, and
// the CUDA IPC and NCCL requests through their planes, one thread per connection.
// Gradient bytes are received straight into the group's staging slot and gather bytes
// are sent straight from the version's snapshot, except that an answer given while the
// worker's next pipelined request is already read may be copied to leave with the next
// one (transport::Delivery::kMayHold, over TCP and TLS alike; the thread sends what it
// holds before any wait, server/before_blocking.h). A refused request gets a precise
// status and the connection stays usable when its stream is still in sync; garbage
// frames close it. Nothing a peer sends can crash the server or stop it from serving
// others: at most max_hellos connections wait for their hello at once, and a connection
// past that closes the one that has waited longest (a flood of silent connections
// cannot use up the server's threads, and a client's hello, which follows its connect
// at once, still gets through); a thread that cannot be started closes its connection.
//
// Start/Stop from one thread; the rest is internal.
//
//   DataServer data(registry, driver, ipc, nccl, sessions, stats, {});
//   FLATSHARD_RETURN_IF_ERROR(data.Start("127.0.0.1", 7071));
//   ...; data.Stop();
#ifndef FLATSHARD_SERVER_DATA_SERVER_H_
#define FLATSHARD_SERVER_DATA_SERVER_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/auth.h"
#include "server/ipc_plane.h"
#include "server/nccl_plane.h"
#include "server/registry.h"
#include "server/stats.h"
#include "server/step_driver.h"
#include "transport/data_protocol.h"
#include "transport/transport.h"

namespace flatshard::server {

struct DataServerOptions {
  absl::Duration hello_timeout = absl::Seconds(5);  // connect -> valid hello
  absl::Duration io_timeout = absl::Seconds(60);    // silence inside a request (--data_io_timeout)
  absl::Duration idle_timeout = absl::Hours(24);    // silence between requests (--data_idle_timeout)
  int64_t max_drain_bytes = int64_t{256} << 20;     // larger refused payloads close the connection
  int max_hellos = 1024;                             // connections waiting for their hello at once
  // Wraps each accepted connection before its hello (TLS: tls::ServerSide with the
  // context of the moment); empty: plain TCP. A connection it refuses is closed.
  transport::SecureAcceptedLayer secure = {};
};

class DataServer {
 public:
  DataServer(Registry& registry, StepDriver& driver, IpcPlane& ipc, NcclPlane& nccl,
             const SessionTokens& sessions, ServerStats& stats, DataServerOptions options);
  ~DataServer();

  // Binds host:port (0: any free port) and starts accepting. Unavailable if it cannot bind.
  [[nodiscard]] absl::Status Start(const std::string& host, int port);
  int port() const;
  // Stops accepting, shuts every connection down (failing transfers in flight) and
  // waits for all connection threads to finish. Idempotent.
  void Stop();

 private:
  void AcceptLoop();
  void ServeConnection(uint64_t id, std::unique_ptr<transport::Connection> conn);
  // Returns false when the connection must be closed. Connection `id` leaves the hello
  // wait before it is told it may go on.
  bool Authenticate(transport::Connection& conn, uint64_t id);
  // Takes connection `id` off the connections waiting for their hello: false if it was
  // not (closed as the longest waiting, or taken off already).
  bool LeaveHelloWait(uint64_t id);
  bool ServeRequest(transport::Connection& conn, const transport::Request& request);
  bool ServeGather(transport::Connection& conn, const transport::Request& request);
  bool ServeReceive(transport::Connection& conn, const transport::Request& request);
  // The staging slot for a scatter, a message of the exchange between replica groups or
  // initial values, and its release.
  absl::StatusOr<ReceiveSlot> BeginReceive(Group& group, const transport::Request& request, SlotPart part);
  static void AbortReceive(Group& group, const transport::Request& request, const ReceiveSlot& slot);
  // Receives the fixed-size head that starts `request`'s payload (`request_name`: "scatter
  // part") into `head` and takes it off request.payload_bytes; otherwise as RecvTarget.
  std::optional<bool> RecvHead(transport::Connection& conn, transport::Request& request, absl::Span<std::byte> head,
                               absl::string_view request_name);
  // Receives the fixed-size payload of a GPU-plane request (`request_name`: "a CUDA IPC
  // request") into `target`. Refuses a payload of another size; then, or when the
  // connection fails, returns what ServeRequest should return; nullopt when `target`
  // holds the payload.
  std::optional<bool> RecvTarget(transport::Connection& conn, const transport::Request& request,
                                 absl::Span<std::byte> target, absl::string_view request_name);
  // kSetHyperparams: the settings parsed and applied (server/hyperparams.h), the outcome answered.
  bool ServeSetHyperparams(transport::Connection& conn, const transport::Request& request);
  bool ServeIpc(transport::Connection& conn, const transport::Request& request);
  bool ServeNccl(transport::Connection& conn, const transport::Request& request);
  // Counts a request answered with an error (ServerStats::errors) and logs it
  // (server/log.h WorthAWarning; warnings through ServerStats::warnings, per op and code); `request` is
  // null for a connection refused or closed before its first request.
  void CountError(const transport::Request* request, const absl::Status& status);
  // Refuses a request whose payload is still on the wire: drains it when small enough.
  bool Refuse(transport::Connection& conn, const transport::Request& request,
              const absl::Status& status);

  Registry& registry_;
  StepDriver& driver_;
  IpcPlane& ipc_;
  NcclPlane& nccl_;
  const SessionTokens& sessions_;
  ServerStats& stats_;
  // stats_.data_requests' histogram of each op, by its number (resolved once: no lookup
  // per request).
  std::array<LatencyHistogram*, static_cast<size_t>(transport::kLastDataOp) + 1> op_latency_{};
  const DataServerOptions options_;
  std::unique_ptr<transport::Listener> listener_;
  std::thread accept_thread_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, transport::Connection*> connections_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> awaiting_hello_ ABSL_GUARDED_BY(mu_);  // ids, oldest first
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_DATA_SERVER_H_
