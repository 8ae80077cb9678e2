// For TLS tests: a gRPC server presenting a given certificate (and asking clients for
// theirs), whether credentials complete a handshake with it, and which certificate they
// present.
//
//   const TlsServer server(cert_pem, key_pem);
//   EXPECT_TRUE(Handshakes(credentials, server.port));
#ifndef FLATSHARD_TESTS_TLS_TLS_HANDSHAKE_H_
#define FLATSHARD_TESTS_TLS_TLS_HANDSHAKE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "proto/flatshard.grpc.pb.h"

namespace flatshard::testing {

// A TLS gRPC server on 127.0.0.1 presenting `cert` with `key` (or serving with
// `credentials`), on a port of its own; with `client_ca`, it asks every client for a
// certificate that CA signed. GetStatus
// answers OK and keeps the common name of the client certificate it came with (Unimplemented
// for every other call). `server` is null if it could not start.
struct TlsServer {
  TlsServer(const std::string& cert, const std::string& key, const std::string& client_ca = "")
      : TlsServer(Credentials(cert, key, client_ca)) {}
  explicit TlsServer(const std::shared_ptr<grpc::ServerCredentials>& credentials) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", credentials, &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  static std::shared_ptr<grpc::ServerCredentials> Credentials(const std::string& cert, const std::string& key,
                                                              const std::string& client_ca) {
    grpc::SslServerCredentialsOptions options(client_ca.empty()
                                                  ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    options.pem_key_cert_pairs.push_back({key, cert});
    options.pem_root_certs = client_ca;
    return grpc::SslServerCredentials(options);
  }
  ~TlsServer() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now()));
  }

  struct NamingService : v1::Flatshard::Service {
    grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest*, v1::ServerStatus*) override {
      std::string name;
      for (const grpc::string_ref& value : context->auth_context()->FindPropertyValues("x509_common_name")) {
        name.assign(value.data(), value.size());
      }
      absl::MutexLock lock(&mu);
      last_client = name;
      return grpc::Status::OK;
    }
    absl::Mutex mu;
    std::string last_client ABSL_GUARDED_BY(mu);
  };

  int port = 0;
  NamingService service;
  std::unique_ptr<grpc::Server> server;
};

// Credentials trusting `ca` and presenting `cert` with `key` (none when empty), read once.
inline std::shared_ptr<grpc::ChannelCredentials> ClientCredentials(const std::string& ca, const std::string& cert = "",
                                                                   const std::string& key = "") {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca;
  options.pem_cert_chain = cert;
  options.pem_private_key = key;
  return grpc::SslCredentials(options);
}

// The common name of the certificate a client with `credentials` presents to `server`
// in a new connection; "(none)" when it presents none, "(refused)" when the call fails.
inline std::string PresentedName(const std::shared_ptr<grpc::ChannelCredentials>& credentials, TlsServer& server) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  auto stub = v1::Flatshard::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server.port), credentials, args));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  v1::ServerStatus status;
  if (!stub->GetStatus(&context, v1::GetStatusRequest(), &status).ok()) return "(refused)";
  absl::MutexLock lock(&server.service.mu);
  return server.service.last_client.empty() ? "(none)" : server.service.last_client;
}

// Whether a new channel with `credentials` completes its handshake with 127.0.0.1:`port`
// (false once it fails, or after 20 s).
inline bool Handshakes(const std::shared_ptr<grpc::ChannelCredentials>& credentials, int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own, not one failed before
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), credentials, args);
  const auto deadline = absl::ToChronoTime(absl::Now() + absl::Seconds(20));
  for (grpc_connectivity_state state = channel->GetState(true);; state = channel->GetState(true)) {
    if (state == GRPC_CHANNEL_READY) return true;
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || !channel->WaitForStateChange(state, deadline)) return false;
  }
}

// Whether Handshakes(credentials, port) comes to `want` within 20 s (a file watcher
// picking a change up), trying every 0.2 s.
inline bool ComesToHandshake(const std::shared_ptr<grpc::ChannelCredentials>& credentials, int port, bool want) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (Handshakes(credentials, port) != want) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(200));
  }
  return true;
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_TLS_TLS_HANDSHAKE_H_
