#include "client/control_plane.h"

#include <future>

#include "absl/strings/str_cat.h"
#include "client/control_channel.h"
#include "client/wait_hook.h"
#include "core/status_macros.h"
#include "proto/keepalive.h"

namespace flatshard::client_internal {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view server) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("server ", server, ": ", status.error_message()));
}

absl::StatusOr<std::unique_ptr<ControlPlane>> ControlPlane::Create(const ClientOptions& options) {
  FLATSHARD_ASSIGN_OR_RETURN(ControlCredentials credentials, ControlPlaneCredentials(options));
  std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs;
  for (const std::string& address : options.servers) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(65 << 20);  // export chunks of up to 64 MiB
    SetKeepalive(args, options.keepalive);
    stubs.push_back(v1::Flatshard::NewStub(grpc::CreateCustomChannel(address, credentials.credentials, args)));
  }
  return std::unique_ptr<ControlPlane>(new ControlPlane(options, std::move(credentials), std::move(stubs)));
}

ControlPlane::ControlPlane(const ClientOptions& options, ControlCredentials credentials,
                           std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs)
    : servers_(options.servers),
      token_(options.token),
      timeout_(options.timeout),
      model_timeout_(options.model_timeout),
      tls_files_(std::move(credentials.files)),
      data_tls_(std::move(credentials.data_tls)),
      stubs_(std::move(stubs)) {}

void ControlPlane::Prepare(grpc::ClientContext& ctx, absl::Duration timeout) const {
  ctx.set_deadline(
      absl::ToChronoTime(absl::Now() + (timeout > absl::ZeroDuration() ? timeout : timeout_)));
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
}

absl::Status ControlPlane::Named(size_t server, const grpc::Status& status) const {
  return FromGrpc(status, servers_[server]);
}

absl::Status ControlPlane::Stopped(size_t server) const {
  return absl::CancelledError(absl::StrCat("server ", servers_[server], ": the call was stopped"));
}

void ControlPlane::AwaitEvents(grpc::CompletionQueue& queue, size_t events,
                               const std::function<void(void*)>& on_event) {
  void* tag = nullptr;
  bool ok = false;
  const std::function<void()>* hook = ThreadWaitHook();
  for (size_t seen = 0; seen < events; ++seen) {
    if (hook == nullptr) {
      (void)queue.Next(&tag, &ok);
    } else {
      while (queue.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + kWaitSlice)) ==
             grpc::CompletionQueue::TIMEOUT) {
        (*hook)();
      }
    }
    on_event(tag);
  }
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
}

absl::Status ControlPlane::OnAllServersInParallel(
    const std::function<absl::Status(size_t)>& call) const {
  std::vector<std::future<absl::Status>> results;
  for (size_t i = 0; i < stubs_.size(); ++i) {
    results.push_back(std::async(std::launch::async, call, i));
  }
  absl::Status status;
  for (auto& result : results) status.Update(GetCallingWaitHook(result));
  return status;
}

}  // namespace flatshard::client_internal
