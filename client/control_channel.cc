#include "client/control_channel.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "tls/certificates.h"
#include "tls/credentials.h"
#include "tls/tls_connection.h"

namespace flatshard::client_internal {
namespace {

// tls::CheckClientUse for the client certificate of `cert_file`: one that may not prove a
// client is refused at Connect, and not taken as a renewal, rather than refused by every
// server's handshake.
absl::Status UsableByAClient(const std::string& cert_file, const tls::KeyPair::Pem& pair) {
  return tls::CheckClientUse(pair.cert_chain, absl::StrCat("tls_cert_file=", cert_file));
}

// A data connection wrapped in TLS, trusting the CAs of `roots` and presenting `pair` (a
// client certificate; empty: none).
absl::StatusOr<std::unique_ptr<transport::Connection>> DataTls(std::unique_ptr<transport::Connection> tcp,
                                                               const std::string& host, const std::string& roots,
                                                               const tls::KeyPair::Pem& pair) {
  FLATSHARD_ASSIGN_OR_RETURN(tls::SslContext context,
                             tls::ClientContext(roots, pair.cert_chain, pair.private_key, "tls_ca_file"));
  return tls::ClientSide(std::move(tcp), std::move(context), host);
}

absl::StatusOr<ControlCredentials> Reloaded(const ClientOptions& options) {
  auto files = std::make_unique<WatchedTlsFiles>();
  FLATSHARD_ASSIGN_OR_RETURN(files->bundle, tls::CaBundle::Start(options.tls_ca_file, "tls_ca_file"));
  if (!options.tls_cert_file.empty()) {
    FLATSHARD_ASSIGN_OR_RETURN(files->pair, tls::KeyPair::Start(options.tls_cert_file, "tls_cert_file",
                                                                options.tls_key_file, "tls_key_file"));
    FLATSHARD_RETURN_IF_ERROR(UsableByAClient(options.tls_cert_file, files->pair->current()));
  }
  files->reloader = std::make_unique<tls::Reloader>(
      options.tls_reload_interval, [files = files.get(), cert_file = options.tls_cert_file] {
        (void)files->bundle->Reload();
        if (files->pair != nullptr) {
          (void)files->pair->Reload([&](const tls::KeyPair::Pem& pem) { return UsableByAClient(cert_file, pem); });
        }
      });
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      tls::WatchedChannelCredentials(files->bundle.get(), files->pair.get());
  transport::SecureLayer data_tls = [files = files.get()](std::unique_ptr<transport::Connection> tcp,
                                                          const std::string& host) {
    return DataTls(std::move(tcp), host, files->bundle->current(),
                   files->pair != nullptr ? files->pair->current() : tls::KeyPair::Pem{});
  };
  return ControlCredentials{std::move(credentials), std::move(files), std::move(data_tls)};
}

absl::StatusOr<ControlCredentials> ReadOnce(const ClientOptions& options) {
  grpc::SslCredentialsOptions ssl;
  FLATSHARD_ASSIGN_OR_RETURN(ssl.pem_root_certs, tls::ReadCaBundle(options.tls_ca_file, "tls_ca_file"));
  tls::KeyPair::Pem pair;
  if (!options.tls_cert_file.empty()) {
    FLATSHARD_ASSIGN_OR_RETURN(pair, tls::KeyPair::Read(options.tls_cert_file, "tls_cert_file", options.tls_key_file,
                                                        "tls_key_file"));
    FLATSHARD_RETURN_IF_ERROR(UsableByAClient(options.tls_cert_file, pair));
    ssl.pem_cert_chain = pair.cert_chain;
    ssl.pem_private_key = pair.private_key;
  }
  transport::SecureLayer data_tls = [roots = ssl.pem_root_certs, pair = std::move(pair)](
                                        std::unique_ptr<transport::Connection> tcp, const std::string& host) {
    return DataTls(std::move(tcp), host, roots, pair);
  };
  return ControlCredentials{grpc::SslCredentials(ssl), nullptr, std::move(data_tls)};
}

}  // namespace

absl::StatusOr<ControlCredentials> ControlPlaneCredentials(const ClientOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together: the client certificate and its private key");
  }
  if (options.tls_ca_file.empty()) {
    if (!options.tls_cert_file.empty()) {
      return absl::InvalidArgumentError(
          "tls_cert_file needs tls_ca_file: a client certificate is presented over TLS, which is off without a CA "
          "bundle");
    }
    return ControlCredentials{grpc::InsecureChannelCredentials(), nullptr, nullptr};
  }
  if (options.tls_reload_interval <= absl::ZeroDuration()) return ReadOnce(options);
  absl::StatusOr<ControlCredentials> reloaded = Reloaded(options);
  if (!absl::IsFailedPrecondition(reloaded.status())) return reloaded;
  return absl::FailedPreconditionError(
      absl::StrCat(reloaded.status().message(), "; tls_reload_interval=0 reads the TLS files once"));
}

absl::Status WithUnreachableHint(const absl::Status& status, const ClientOptions& options) {
  if (!absl::IsUnavailable(status)) return status;
  // Refused: nothing listens there, which no TLS setting changes.
  if (absl::StrContains(status.message(), "Connection refused")) {
    return absl::Status(status.code(), absl::StrCat(status.message(),
                                                    " (nothing listens at that address: is flatshard-server running "
                                                    "there, with that --listen address?)"));
  }
  if (options.tls_ca_file.empty()) {
    return absl::Status(status.code(), absl::StrCat(status.message(),
                                                    " (this client speaks plaintext gRPC: a server started with "
                                                    "--tls_cert_file needs tls_ca_file set here)"));
  }
  const std::string presented =
      options.tls_cert_file.empty()
          ? "presents no client certificate: a server started with --tls_client_ca_file needs tls_cert_file and "
            "tls_key_file set here"
          : absl::StrCat("presents tls_cert_file=", options.tls_cert_file,
                         ": a server started with --tls_client_ca_file must trust its CA");
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), " (this client speaks TLS and trusts tls_ca_file=",
                                   options.tls_ca_file,
                                   ": the server must run with --tls_cert_file, and its certificate be signed by "
                                   "that CA for the host dialed; it ",
                                   presented, ")"));
}

}  // namespace flatshard::client_internal
