// RequestLog: a gRPC server interceptor that times every control-plane call into
// `latencies` (by method, "flatshard.v1.Flatshard/GetStatus": from its arrival to its
// status sent), counts those that end with an error into `errors` (by method and code),
// and logs its outcome (server/log.h): at debug every call with its method,
// peer (with mutual TLS, also the names its client certificate gives), code and time; at
// warning the refusals WorthAWarning picks, whatever the level, at most LogThrottle's
// burst per method and code every period (a fleet retrying with a wrong token).
// Thread-safe: one interceptor per call; `latencies`, `errors` and `warnings` must outlive
// the gRPC server.
//
//   std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
//   creators.push_back(std::make_unique<RequestLogFactory>(stats.rpcs, stats.rpc_errors, stats.warnings));
//   builder.experimental().SetInterceptorCreators(std::move(creators));
#ifndef FLATSHARD_SERVER_REQUEST_LOG_H_
#define FLATSHARD_SERVER_REQUEST_LOG_H_

#include <grpcpp/support/server_interceptor.h>

#include "server/latency_histogram.h"
#include "server/log_throttle.h"
#include "server/rpc_errors.h"

namespace flatshard::server {

class RequestLogFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RequestLogFactory(NamedLatencies& latencies, RpcErrorCounts& errors, LogThrottle& warnings)
      : latencies_(latencies), errors_(errors), warnings_(warnings) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  NamedLatencies& latencies_;
  RpcErrorCounts& errors_;
  LogThrottle& warnings_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_REQUEST_LOG_H_
