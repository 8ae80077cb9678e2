// For TLS tests: a gRPC server presenting a given certificate, and whether credentials
// complete a handshake with it.
//
//   const TlsServer server(cert_pem, key_pem);
//   EXPECT_TRUE(Handshakes(credentials, server.port));
#ifndef FLATSHARD_TESTS_TLS_TLS_HANDSHAKE_H_
#define FLATSHARD_TESTS_TLS_TLS_HANDSHAKE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/flatshard.grpc.pb.h"

namespace flatshard::testing {

// A TLS gRPC server on 127.0.0.1 presenting `cert` with `key`, on a port of its own
// (every call answered Unimplemented). `server` is null if it could not start.
struct TlsServer {
  TlsServer(const std::string& cert, const std::string& key) {
    grpc::SslServerCredentialsOptions options;
    options.pem_key_cert_pairs.push_back({key, cert});
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(options), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~TlsServer() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  int port = 0;
  v1::Flatshard::Service service;
  std::unique_ptr<grpc::Server> server;
};

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
