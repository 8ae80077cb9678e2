// The gRPC channel credentials a client uses for the servers' control plane: TLS, with
// the servers' certificates checked against the CA bundle in `tls_ca_file`, when that is
// set; plaintext otherwise (server/tls.h says what each side needs). With a reload
// interval the bundle is read again that often (tls/ca_bundle.h).
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto credentials, ControlPlaneCredentials(options.tls_ca_file, interval));
//   auto channel = grpc::CreateChannel(address, credentials.credentials);  // outlived by credentials.bundle
#ifndef FLATSHARD_CLIENT_CONTROL_CHANNEL_H_
#define FLATSHARD_CLIENT_CONTROL_CHANNEL_H_

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tls/ca_bundle.h"

namespace flatshard::client_internal {

struct ControlCredentials {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::unique_ptr<tls::CaBundle> bundle;  // keeps the bundle current (null: read once, or no TLS)
};

// InvalidArgument naming the file when it cannot be read or a certificate of it does not
// parse; FailedPrecondition when reloads cannot be set up (no /proc).
[[nodiscard]] absl::StatusOr<ControlCredentials> ControlPlaneCredentials(const std::string& tls_ca_file,
                                                                         absl::Duration reload_interval);

// `status` from a server that could not be reached, with a hint at the likely cause:
// nothing listening at its address, or a TLS setting that differs between this client
// and the servers.
absl::Status WithUnreachableHint(const absl::Status& status, const std::string& tls_ca_file);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CONTROL_CHANNEL_H_
