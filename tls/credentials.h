// gRPC credentials over files kept current (tls/ca_bundle.h, tls/key_pair.h): gRPC's
// certificate watchers read their published files every kWatcherRefresh (a small read of
// a memfd), so the handshakes that start a second after a Reload use what it took, and
// connections already open carry on.
//
//   auto channel = grpc::CreateChannel(address, WatchedChannelCredentials(bundle.get(), pair.get()));
#ifndef FLATSHARD_TLS_CREDENTIALS_H_
#define FLATSHARD_TLS_CREDENTIALS_H_

#include <memory>

#include "absl/time/time.h"
#include "tls/ca_bundle.h"
#include "tls/key_pair.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace flatshard::tls {

inline constexpr absl::Duration kWatcherRefresh = absl::Seconds(1);

// Credentials of a TLS client that checks the host name a server is dialed by against
// its certificate, and the certificate against `roots` (null: the system's roots), and
// presents `identity` to a server that asks for a client certificate (null: none).
// Precondition: at least one is not null; both outlive what is returned.
std::shared_ptr<grpc::ChannelCredentials> WatchedChannelCredentials(const CaBundle* roots, const KeyPair* identity);

// Credentials of a TLS server presenting `identity`; with `client_roots`, it asks every
// client for a certificate and completes only handshakes whose certificate those CAs
// signed. Precondition: both outlive what is returned.
std::shared_ptr<grpc::ServerCredentials> WatchedServerCredentials(const KeyPair& identity,
                                                                  const CaBundle* client_roots);

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_CREDENTIALS_H_
