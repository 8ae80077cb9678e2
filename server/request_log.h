// RequestLog: a gRPC server interceptor that logs the outcome of every control-plane call
// (server/log.h): at debug every call with its method, peer, code and time; at warning
// the refusals WorthAWarning picks, whatever the level. Thread-safe: one interceptor per
// call.
//
//   std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
//   creators.push_back(std::make_unique<RequestLogFactory>());
//   builder.experimental().SetInterceptorCreators(std::move(creators));
#ifndef FLATSHARD_SERVER_REQUEST_LOG_H_
#define FLATSHARD_SERVER_REQUEST_LOG_H_

#include <grpcpp/support/server_interceptor.h>

namespace flatshard::server {

class RequestLogFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_REQUEST_LOG_H_
