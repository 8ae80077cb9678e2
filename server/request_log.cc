#include "server/request_log.h"

#include <grpcpp/server_context.h>
#include <spdlog/spdlog.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "server/log.h"

namespace flatshard::server {
namespace {

class RequestLog : public grpc::experimental::Interceptor {
 public:
  RequestLog(grpc::experimental::ServerRpcInfo* info, NamedLatencies& latencies) : info_(info), latencies_(latencies) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const absl::Duration took = absl::FromChrono(LatencyClock::now() - start_);
      latencies_.For(absl::StripPrefix(info_->method(), "/")).Record(took);
      const grpc::Status status = methods->GetSendStatus();
      const absl::StatusCode code = static_cast<absl::StatusCode>(status.error_code());  // the same numbers
      const spdlog::level::level_enum level = WorthAWarning(code) ? spdlog::level::warn : spdlog::level::debug;
      if (spdlog::should_log(level)) {
        const double ms = absl::ToDoubleMilliseconds(took);
        const std::string peer = info_->server_context()->peer();
        if (status.ok()) {
          spdlog::log(level, "rpc {} from {}: OK in {:.1f} ms", info_->method(), peer, ms);
        } else {
          spdlog::log(level, "rpc {} from {}: {} in {:.1f} ms: {}", info_->method(), peer,
                      absl::StatusCodeToString(code), ms, status.error_message());
        }
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  NamedLatencies& latencies_;
  const LatencyClock::time_point start_ = LatencyClock::now();
};

}  // namespace

grpc::experimental::Interceptor* RequestLogFactory::CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) {
  return new RequestLog(info, latencies_);
}

}  // namespace flatshard::server
