// Traffic counters, requests in flight and request latencies of one server, updated by
// the data plane (and the RPC interceptor, server/request_log.h: lock-free but for the
// calls in flight, which a shutdown waits on) and read by the status RPC; and the
// throttle their warnings share. Thread-safe.
#ifndef FLATSHARD_SERVER_STATS_H_
#define FLATSHARD_SERVER_STATS_H_

#include <atomic>
#include <cstdint>

#include "server/calls_in_flight.h"
#include "server/latency_histogram.h"
#include "server/log_throttle.h"
#include "server/rpc_errors.h"

namespace flatshard::server {

struct ServerStats {
  std::atomic<int64_t> bytes_received{0};
  std::atomic<int64_t> bytes_sent{0};
  std::atomic<int64_t> gathers{0};
  std::atomic<int64_t> scatters{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int32_t> open_data_connections{0};
  // Data-plane requests being served now (a gather waiting for its version among them),
  // and control-plane calls (a shutdown waits for these).
  std::atomic<int32_t> data_requests_in_flight{0};
  CallsInFlight rpcs_in_flight;
  std::atomic<int64_t> ipc_gathers{0};   // CUDA IPC plane (also counted in gathers)
  std::atomic<int64_t> ipc_scatters{0};  // CUDA IPC plane (also counted in scatters)
  std::atomic<int64_t> nccl_gathers{0};   // NCCL plane (also counted in gathers)
  std::atomic<int64_t> nccl_scatters{0};  // NCCL plane (also counted in scatters)
  // Hybrid-sharded jobs' exchange between replica groups (server/step_driver.h),
  // delivered to peers and taken from them; not counted in bytes_sent/bytes_received.
  std::atomic<int64_t> exchange_bytes_sent{0};
  std::atomic<int64_t> exchange_bytes_received{0};
  // By data-plane op (transport::DataOpName) and by RPC method ("flatshard.v1.Flatshard/GetStatus").
  NamedLatencies data_requests;
  NamedLatencies rpcs;
  RpcErrorCounts rpc_errors;  // the RPCs of `rpcs` that ended with an error
  // The warnings of refused requests, control and data plane, at most a burst of each kind
  // per period (server/log.h WorthAWarning).
  LogThrottle warnings;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_STATS_H_
