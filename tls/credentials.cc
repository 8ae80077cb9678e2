#include "tls/credentials.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <string>

namespace flatshard::tls {
namespace {

// A watcher of what `identity` and `roots` publish (either may be null).
std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Watcher(const KeyPair* identity,
                                                                            const CaBundle* roots) {
  const std::string pair = identity != nullptr ? identity->watched_path() : "";
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      pair, pair, roots != nullptr ? roots->watched_path() : "",
      static_cast<unsigned int>(absl::ToInt64Seconds(kWatcherRefresh)));
}

}  // namespace

std::shared_ptr<grpc::ChannelCredentials> WatchedChannelCredentials(const CaBundle* roots, const KeyPair* identity) {
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Watcher(identity, roots));
  if (roots != nullptr) options.watch_root_certs();  // otherwise gRPC's default roots
  if (identity != nullptr) options.watch_identity_key_cert_pairs();
  options.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

std::shared_ptr<grpc::ServerCredentials> WatchedServerCredentials(const KeyPair& identity,
                                                                  const CaBundle* client_roots) {
  grpc::experimental::TlsServerCredentialsOptions options(Watcher(&identity, client_roots));
  options.watch_identity_key_cert_pairs();
  if (client_roots != nullptr) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace flatshard::tls
