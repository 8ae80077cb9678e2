#include "server/tls.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/tls_files.h"
#include "tls/certificates.h"
#include "tls/credentials.h"
#include "tls/tls_connection.h"

namespace flatshard::server {

absl::Status ValidateTls(const TlsOptions& tls) {
  if (!tls.enabled()) {
    if (!tls.private_key.empty() || !tls.root_certs.empty() || !tls.client_root_certs.empty() ||
        !tls.client_ca_file.empty() || tls.metrics_client_certificates || tls.data_plane) {
      return absl::InvalidArgumentError(
          "--tls_key_file, --tls_ca_file, --tls_client_ca_file, --metrics_client_certificates and "
          "--tls_data_plane need --tls_cert_file (TLS is off without a certificate)");
    }
    return absl::OkStatus();
  }
  if (tls.private_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file needs --tls_key_file, the certificate's private key");
  }
  FLATSHARD_RETURN_IF_ERROR(tls::CheckIdentity(tls.cert_chain, "--tls_cert_file", tls.private_key, "--tls_key_file")
                                .status());
  if (!tls.root_certs.empty() || !tls.ca_file.empty()) {
    FLATSHARD_RETURN_IF_ERROR(tls::CheckCertificates(tls.root_certs, "--tls_ca_file"));
  }
  if (tls.requires_client_certificates()) {
    FLATSHARD_RETURN_IF_ERROR(tls::CheckCertificates(tls.client_root_certs, "--tls_client_ca_file"));
    FLATSHARD_RETURN_IF_ERROR(CheckPeersAccept(tls));
  } else if (tls.metrics_client_certificates) {
    return absl::InvalidArgumentError(
        "--metrics_client_certificates needs --tls_client_ca_file, the CAs that sign the scrapes' certificates");
  }
  return absl::OkStatus();
}

absl::Status CheckPeersAccept(const TlsOptions& tls) {
  const absl::Status verified =
      tls::CheckClientCertificate(tls.cert_chain, "--tls_cert_file", tls.client_root_certs, "--tls_client_ca_file");
  if (verified.ok()) return verified;
  return absl::InvalidArgumentError(
      absl::StrCat(verified.message(), ": servers present their own certificate when they call each other, so "
                                       "their CA must be in the client CA bundle and their certificates allow "
                                       "clientAuth"));
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsOptions& tls, const TlsFiles* files) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (files != nullptr) return tls::WatchedServerCredentials(files->pair(), files->client_roots());
  grpc::SslServerCredentialsOptions options(tls.requires_client_certificates()
                                                ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({tls.private_key, tls.cert_chain});
  options.pem_root_certs = tls.client_root_certs;
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> PeerCredentials(const TlsOptions& tls, const TlsFiles* files) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  if (files != nullptr) return tls::WatchedChannelCredentials(files->ca_bundle(), &files->pair());
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.root_certs;  // empty: gRPC's default roots
  options.pem_private_key = tls.private_key;
  options.pem_cert_chain = tls.cert_chain;
  return grpc::SslCredentials(options);
}

namespace {

// The TLS files in use.
TlsOptions Current(const TlsOptions& tls, const TlsFiles* files) { return files != nullptr ? files->current() : tls; }

}  // namespace

transport::SecureAcceptedLayer DataServerTls(const TlsOptions& tls, const TlsFiles* files) {
  return [tls, files](std::unique_ptr<transport::Connection> tcp)
             -> absl::StatusOr<std::unique_ptr<transport::Connection>> {
    const TlsOptions now = Current(tls, files);
    FLATSHARD_ASSIGN_OR_RETURN(
        tls::SslContext context,
        tls::ServerContext(now.cert_chain, "--tls_cert_file", now.private_key, "--tls_key_file",
                           now.requires_client_certificates() ? now.client_root_certs : "", "--tls_client_ca_file"));
    return tls::ServerSide(std::move(tcp), std::move(context));
  };
}

transport::SecureLayer PeerDataTls(const TlsOptions& tls, const TlsFiles* files) {
  return [tls, files](std::unique_ptr<transport::Connection> tcp,
                      const std::string& host) -> absl::StatusOr<std::unique_ptr<transport::Connection>> {
    const TlsOptions now = Current(tls, files);
    FLATSHARD_ASSIGN_OR_RETURN(tls::SslContext context,
                               tls::ClientContext(now.root_certs, now.cert_chain, now.private_key, "--tls_ca_file"));
    return tls::ClientSide(std::move(tcp), std::move(context), host);
  };
}

}  // namespace flatshard::server
