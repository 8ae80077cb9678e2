// RequestLog: a gRPC server interceptor that counts every control-plane call in
// `stats.rpcs_in_flight` from its arrival to its end, times it into `stats.rpcs` (by
// method, "flatshard.v1.Flatshard/GetStatus": from its arrival to its status sent), counts
// those that end with an error into `stats.rpc_errors` (by method and code), and logs its
// outcome (server/log.h): at debug every call with its method,
// peer (with mutual TLS, also the names its client certificate gives), code and time; at
// warning the refusals WorthAWarning picks, whatever the level, at most LogThrottle's
// burst per method and code every period (a fleet retrying with a wrong token, throttled
// by `stats.warnings`). Thread-safe: one interceptor per call; `stats` must outlive the
// gRPC server.
//
//   std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
//   creators.push_back(std::make_unique<RequestLogFactory>(stats));
//   builder.experimental().SetInterceptorCreators(std::move(creators));
#ifndef FLATSHARD_SERVER_REQUEST_LOG_H_
#define FLATSHARD_SERVER_REQUEST_LOG_H_

#include <grpcpp/support/server_interceptor.h>

#include "server/stats.h"

namespace flatshard::server {

class RequestLogFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RequestLogFactory(ServerStats& stats) : stats_(stats) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServerStats& stats_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_REQUEST_LOG_H_
