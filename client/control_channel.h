// The gRPC channel credentials a client uses for the servers' control plane: TLS, with
// the servers' certificates checked against the CA bundle in `tls_ca_file`, when that is
// set, presenting the client certificate of `tls_cert_file` / `tls_key_file` to servers
// that ask for one (--tls_client_ca_file); plaintext otherwise (server/tls.h says what
// each side needs). With a reload interval the files are read again that often
// (tls/ca_bundle.h, tls/key_pair.h), so that later connections trust a CA added to the
// bundle and present a renewed certificate.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto credentials, ControlPlaneCredentials(options));
//   auto channel = grpc::CreateChannel(address, credentials.credentials);  // outlived by credentials.files
#ifndef FLATSHARD_CLIENT_CONTROL_CHANNEL_H_
#define FLATSHARD_CLIENT_CONTROL_CHANNEL_H_

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatshard/client.h"
#include "tls/ca_bundle.h"
#include "tls/key_pair.h"
#include "tls/reloader.h"
#include "transport/data_protocol.h"

namespace flatshard::client_internal {

// The files a client's credentials watch, kept current while this lives.
struct WatchedTlsFiles {
  std::unique_ptr<tls::CaBundle> bundle;
  std::unique_ptr<tls::KeyPair> pair;       // null without a client certificate
  std::unique_ptr<tls::Reloader> reloader;  // last: stopped first
};

struct ControlCredentials {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::unique_ptr<WatchedTlsFiles> files;  // null: read once, or no TLS
  // Wraps a data connection to a server whose data plane speaks TLS (--tls_data_plane),
  // checking its certificate and presenting the client's as the credentials do, with the
  // files in use when it is made; empty without TLS. Valid while `files` lives.
  transport::SecureLayer data_tls;
};

// InvalidArgument naming the option when a file cannot be read or does not parse, a
// certificate comes without its key (or the other way round), the key is not the
// certificate's, a certificate has expired, or a client certificate is given without
// tls_ca_file; FailedPrecondition when reloads cannot be set up (no /proc).
[[nodiscard]] absl::StatusOr<ControlCredentials> ControlPlaneCredentials(const ClientOptions& options);

// `status` from a server that could not be reached, with a hint at the likely cause:
// nothing listening at its address, or a TLS setting that differs between this client
// (`options`) and the servers.
absl::Status WithUnreachableHint(const absl::Status& status, const ClientOptions& options);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CONTROL_CHANNEL_H_
