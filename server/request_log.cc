#include "server/request_log.h"

#include <grpcpp/server_context.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "server/log.h"

namespace flatshard::server {
namespace {

// The caller as the log names it: its address, then, with mutual TLS, the names its
// certificate gives (subject alternative names, or the common name).
std::string Caller(const grpc::ServerContextBase& context) {
  std::string caller = context.peer();
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return caller;
  std::vector<std::string> names;
  for (const grpc::string_ref& name : auth->GetPeerIdentity()) names.emplace_back(name.data(), name.size());
  return absl::StrCat(caller, " (", absl::StrJoin(names, ","), ")");
}

class RequestLog : public grpc::experimental::Interceptor {
 public:
  RequestLog(grpc::experimental::ServerRpcInfo* info, ServerStats& stats)
      : info_(info), latencies_(stats.rpcs), errors_(stats.rpc_errors), warnings_(stats.warnings),
        in_flight_(stats.rpcs_in_flight) {
    in_flight_.Begin();
  }
  ~RequestLog() override { in_flight_.End(); }
  RequestLog(const RequestLog&) = delete;
  RequestLog& operator=(const RequestLog&) = delete;

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const absl::Duration took = absl::FromChrono(LatencyClock::now() - start_);
      const absl::string_view method = absl::StripPrefix(info_->method(), "/");
      latencies_.For(method).Record(took);
      const grpc::Status status = methods->GetSendStatus();
      const absl::StatusCode code = static_cast<absl::StatusCode>(status.error_code());  // the same numbers
      if (!status.ok()) errors_.Add(method, code);
      const spdlog::level::level_enum level = WorthAWarning(code) ? spdlog::level::warn : spdlog::level::debug;
      std::optional<int64_t> held_back = 0;
      if (level == spdlog::level::warn) {
        held_back = warnings_.Admit(absl::StrCat("rpc ", info_->method(), " ", absl::StatusCodeToString(code)));
      }
      if (held_back.has_value() && spdlog::should_log(level)) {
        const double ms = absl::ToDoubleMilliseconds(took);
        const std::string peer = Caller(*info_->server_context());
        if (status.ok()) {
          spdlog::log(level, "rpc {} from {}: OK in {:.1f} ms", info_->method(), peer, ms);
        } else {
          spdlog::log(level, "rpc {} from {}: {} in {:.1f} ms: {}{}", info_->method(), peer,
                      absl::StatusCodeToString(code), ms, status.error_message(), LogThrottle::HeldBack(*held_back));
        }
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  NamedLatencies& latencies_;
  RpcErrorCounts& errors_;
  LogThrottle& warnings_;
  CallsInFlight& in_flight_;
  const LatencyClock::time_point start_ = LatencyClock::now();
};

}  // namespace

grpc::experimental::Interceptor* RequestLogFactory::CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) {
  return new RequestLog(info, stats_);
}

}  // namespace flatshard::server
