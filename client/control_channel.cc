#include "client/control_channel.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/file.h"

namespace flatshard::client_internal {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ControlPlaneCredentials(
    const std::string& tls_ca_file) {
  if (tls_ca_file.empty()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<std::string> roots = ReadFileToString(tls_ca_file);
  if (!roots.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read tls_ca_file=", tls_ca_file, ": ", roots.status().message()));
  }
  if (!absl::StrContains(*roots, "-----BEGIN CERTIFICATE-----")) {
    return absl::InvalidArgumentError(absl::StrCat("tls_ca_file=", tls_ca_file, " holds no PEM certificate"));
  }
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = *std::move(roots);
  return grpc::SslCredentials(options);
}

absl::Status WithUnreachableHint(const absl::Status& status, const std::string& tls_ca_file) {
  if (!absl::IsUnavailable(status)) return status;
  // Refused: nothing listens there, which no TLS setting changes.
  if (absl::StrContains(status.message(), "Connection refused")) {
    return absl::Status(status.code(), absl::StrCat(status.message(),
                                                    " (nothing listens at that address: is flatshard-server running "
                                                    "there, with that --listen address?)"));
  }
  return absl::Status(
      status.code(),
      absl::StrCat(status.message(),
                   tls_ca_file.empty()
                       ? " (this client speaks plaintext gRPC: a server started with "
                         "--tls_cert_file needs tls_ca_file set here)"
                       : absl::StrCat(" (this client speaks TLS and trusts tls_ca_file=", tls_ca_file,
                                      ": the server must run with --tls_cert_file, and its "
                                      "certificate be signed by that CA for the host dialed)")));
}

}  // namespace flatshard::client_internal
