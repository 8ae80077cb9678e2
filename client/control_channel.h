// The gRPC channel credentials a client uses for the servers' control plane: TLS, with
// the servers' certificates checked against the CA bundle in `tls_ca_file`, when that is
// set; plaintext otherwise (server/tls.h says what each side needs).
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto credentials, ControlPlaneCredentials(options.tls_ca_file));
//   auto channel = grpc::CreateChannel(address, credentials);
#ifndef FLATSHARD_CLIENT_CONTROL_CHANNEL_H_
#define FLATSHARD_CLIENT_CONTROL_CHANNEL_H_

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace flatshard::client_internal {

// InvalidArgument naming the file when it cannot be read or holds no PEM certificate.
[[nodiscard]] absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ControlPlaneCredentials(
    const std::string& tls_ca_file);

// `status` from a server that could not be reached, with a hint at the likely cause:
// nothing listening at its address, or a TLS setting that differs between this client
// and the servers.
absl::Status WithUnreachableHint(const absl::Status& status, const std::string& tls_ca_file);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CONTROL_CHANNEL_H_
