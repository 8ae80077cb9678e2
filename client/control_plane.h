// ControlPlane: a client's gRPC stubs for every server of a cluster, in rank order, and
// calls on them that carry the client's deadline and token and turn gRPC errors into
// statuses naming the server. Internal to the client library. Thread-safe (gRPC stubs
// are); creating one connects lazily, so it never blocks.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto control, ControlPlane::Create(options));
//   FLATSHARD_RETURN_IF_ERROR(control->Call(0, &v1::Flatshard::Stub::PrepareAsyncGetStatus, request, &status));
#ifndef FLATSHARD_CLIENT_CONTROL_PLANE_H_
#define FLATSHARD_CLIENT_CONTROL_PLANE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <numeric>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/call_cancellation.h"
#include "client/control_channel.h"
#include "core/status_macros.h"
#include "flatshard/client.h"
#include "proto/flatshard.grpc.pb.h"

namespace flatshard::client_internal {

// `status` as an absl::Status whose message names `server`.
absl::Status FromGrpc(const grpc::Status& status, absl::string_view server);

class ControlPlane {
 public:
  // A unary method as its stub prepares it, &v1::Flatshard::Stub::PrepareAsyncX.
  template <typename Request, typename Response>
  using Method = std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> (v1::Flatshard::Stub::*)(
      grpc::ClientContext*, const Request&, grpc::CompletionQueue*);

  // Channels to options.servers, with options.token, .timeout, .model_timeout,
  // .keepalive and .tls_ca_file.
  // InvalidArgument when the CA file cannot be read.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ControlPlane>> Create(
      const ClientOptions& options);

  int size() const { return static_cast<int>(stubs_.size()); }
  const std::string& address(size_t server) const { return servers_[server]; }
  absl::Duration timeout() const { return timeout_; }
  // The deadline of calls whose work grows with the model (ClientOptions::model_timeout),
  // which may be infinite: the channels' keepalive notices a server that stops answering.
  absl::Duration model_timeout() const { return model_timeout_; }

  // One unary call to `server`, within `timeout` (zero: the client's), which
  // `cancellation` (when given) may cancel, and a stop asked of `stop`'s source (then
  // Cancelled "server <address>: the call was stopped", whether or not it had begun; the
  // server may have acted on it). Blocks, driving the call on this thread, which calls
  // its wait hook meanwhile (flatshard/while_waiting.h). Returns the call's error with
  // the server's address in its message.
  template <typename Request, typename Response>
  [[nodiscard]] absl::Status Call(size_t server, Method<Request, Response> method, const Request& request,
                                  Response* response, absl::Duration timeout = absl::ZeroDuration(),
                                  Cancellation* cancellation = nullptr, std::stop_token stop = {}) const {
    grpc::ClientContext ctx;
    Prepare(ctx, timeout);
    const Registration registered(cancellation, &ctx);
    // Cancels at once when the stop was asked for before; gRPC then fails the call as it starts.
    const std::stop_callback stopped(stop, [&ctx] { ctx.TryCancel(); });
    grpc::CompletionQueue queue;
    grpc::Status status;
    {
      const std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> call =
          (stubs_[server].get()->*method)(&ctx, request, &queue);
      call->StartCall();
      call->Finish(response, &status, &queue);
      AwaitEvents(queue, 1, [](void*) {});
    }
    if (!status.ok() && stop.stop_requested()) return Stopped(server);
    return Named(server, status);
  }

  // Call on each of `servers` at once, within `timeout` (zero: the client's): the calls
  // share one completion queue driven on this thread (no thread per server), so they take
  // one round trip and the longest wait rather than their sum. `responses` gets one per
  // server, in `servers`' order. The first call to fail cancels the others and its error
  // is returned (Cancelled "... the call was stopped" when `stop` ended them).
  template <typename Request, typename Response>
  [[nodiscard]] absl::Status CallEach(const std::vector<int>& servers, Method<Request, Response> method,
                                      const Request& request, std::vector<Response>& responses,
                                      std::stop_token stop = {}, absl::Duration timeout = absl::ZeroDuration()) const {
    std::vector<grpc::ClientContext> contexts(servers.size());  // neither copied nor moved
    std::vector<grpc::Status> statuses(servers.size());
    responses.assign(servers.size(), Response());
    for (grpc::ClientContext& ctx : contexts) Prepare(ctx, timeout);
    auto cancel_all = [&contexts] {
      for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
    };
    const std::stop_callback stopped(stop, cancel_all);
    grpc::CompletionQueue queue;
    const grpc::Status* failed = nullptr;  // the first call to fail
    {
      std::vector<std::unique_ptr<grpc::ClientAsyncResponseReader<Response>>> calls;
      for (size_t k = 0; k < servers.size(); ++k) {
        calls.push_back((stubs_[servers[k]].get()->*method)(&contexts[k], request, &queue));
        calls.back()->StartCall();
        calls.back()->Finish(&responses[k], &statuses[k], &statuses[k]);
      }
      AwaitEvents(queue, servers.size(), [&](void* tag) {
        const auto* status = static_cast<const grpc::Status*>(tag);
        if (status->ok() || failed != nullptr) return;
        failed = status;
        cancel_all();
      });
    }
    if (failed == nullptr) return absl::OkStatus();
    const int server = servers[failed - statuses.data()];
    return stop.stop_requested() ? Stopped(server) : Named(server, *failed);
  }

  // Call on every server in rank order; stops at the first error.
  template <typename Request, typename Response>
  [[nodiscard]] absl::Status CallAll(Method<Request, Response> method, const Request& request, Response* response,
                                     std::stop_token stop = {}) const {
    for (size_t i = 0; i < stubs_.size(); ++i) {
      if (absl::Status status = Call(i, method, request, response, absl::ZeroDuration(), nullptr, stop); !status.ok()) {
        return status;
      }
    }
    return absl::OkStatus();
  }

  // Call on server 0, then, if it succeeded, on all the others at once (CallEach), each
  // within `timeout` (zero: the client's; model_timeout() for calls whose work grows
  // with the model): the others take as long as the slowest of them rather than the
  // sum. Server 0 still decides between callers racing with different requests, as with
  // CallAll, and a call stopped while server 0 has it reaches no other server.
  // `response` is server 0's.
  template <typename Request, typename Response>
  [[nodiscard]] absl::Status CallServerZeroThenOthers(Method<Request, Response> method, const Request& request,
                                                      Response* response, absl::Duration timeout,
                                                      std::stop_token stop = {}) const {
    FLATSHARD_RETURN_IF_ERROR(Call(0, method, request, response, timeout, nullptr, stop));
    std::vector<int> others(stubs_.size() - 1);
    std::iota(others.begin(), others.end(), 1);
    std::vector<Response> ignored;
    return CallEach(others, method, request, ignored, stop, timeout);
  }

  // Runs `call(server)` for every server at once, each on a thread of its own, and waits
  // for all (calling this thread's wait hook meanwhile); the first error (in rank order)
  // wins.
  [[nodiscard]] absl::Status OnAllServersInParallel(
      const std::function<absl::Status(size_t)>& call) const;

  // For streaming calls: the stub, a context to Prepare, and Named for the outcome.
  v1::Flatshard::Stub& stub(size_t server) const { return *stubs_[server]; }
  void Prepare(grpc::ClientContext& ctx, absl::Duration timeout = absl::ZeroDuration()) const;
  absl::Status Named(size_t server, const grpc::Status& status) const;
  // Cancelled: a call to `server` ended by its stop token.
  absl::Status Stopped(size_t server) const;

  // What wraps data connections to a server whose data plane speaks TLS (ControlCredentials::
  // data_tls); empty without TLS. Valid while this lives.
  const transport::SecureLayer& data_tls() const { return data_tls_; }

 private:
  ControlPlane(const ClientOptions& options, ControlCredentials credentials,
               std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs);
  // Waits for `events` events (one per call) on `queue`, handing each one's tag to
  // `on_event` and calling this thread's wait hook every kWaitSlice meanwhile, then shuts
  // `queue` down and drains it.
  static void AwaitEvents(grpc::CompletionQueue& queue, size_t events, const std::function<void(void*)>& on_event);

  const std::vector<std::string> servers_;
  const std::string token_;
  const absl::Duration timeout_;
  const absl::Duration model_timeout_;
  // The TLS files kept current (tls_reload_interval), for the channels' credentials:
  // declared before the channels, which it outlives.
  const std::unique_ptr<WatchedTlsFiles> tls_files_;
  const transport::SecureLayer data_tls_;  // over tls_files_
  const std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CONTROL_PLANE_H_
