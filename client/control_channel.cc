#include "client/control_channel.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard::client_internal {

absl::StatusOr<ControlCredentials> ControlPlaneCredentials(const std::string& tls_ca_file,
                                                          absl::Duration reload_interval) {
  if (tls_ca_file.empty()) return ControlCredentials{grpc::InsecureChannelCredentials(), nullptr};
  if (reload_interval > absl::ZeroDuration()) {
    absl::StatusOr<std::unique_ptr<tls::CaBundle>> bundle =
        tls::CaBundle::Start(tls_ca_file, "tls_ca_file", reload_interval, /*reload_itself=*/true);
    if (!bundle.ok()) {
      if (!absl::IsFailedPrecondition(bundle.status())) return bundle.status();
      return absl::FailedPreconditionError(
          absl::StrCat(bundle.status().message(), "; tls_reload_interval=0 reads tls_ca_file once"));
    }
    std::shared_ptr<grpc::ChannelCredentials> credentials = (*bundle)->Credentials();
    return ControlCredentials{std::move(credentials), *std::move(bundle)};
  }
  grpc::SslCredentialsOptions options;
  FLATSHARD_ASSIGN_OR_RETURN(options.pem_root_certs, tls::ReadCaBundle(tls_ca_file, "tls_ca_file"));
  return ControlCredentials{grpc::SslCredentials(options), nullptr};
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
