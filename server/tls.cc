#include "server/tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"
#include "server/tls_files.h"
#include "tls/certificates.h"

namespace flatshard::server {

absl::Status ValidateTls(const TlsOptions& tls) {
  if (!tls.enabled()) {
    if (!tls.private_key.empty() || !tls.root_certs.empty()) {
      return absl::InvalidArgumentError(
          "--tls_key_file and --tls_ca_file need --tls_cert_file (TLS is off without a certificate)");
    }
    return absl::OkStatus();
  }
  if (tls.private_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file needs --tls_key_file, the certificate's private key");
  }
  FLATSHARD_RETURN_IF_ERROR(tls::CheckCertificates(tls.cert_chain, "--tls_cert_file"));
  FLATSHARD_RETURN_IF_ERROR(tls::CheckKeyPair(tls.cert_chain, "--tls_cert_file", tls.private_key, "--tls_key_file"));
  FLATSHARD_ASSIGN_OR_RETURN(const absl::Time expiry, tls::CertificateChainExpiry(tls.cert_chain));
  if (expiry <= absl::Now()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert_file: a certificate of the chain expired ",
                     absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", expiry, absl::UTCTimeZone()),
                     ": no client or peer would accept it"));
  }
  if (!tls.root_certs.empty() || !tls.ca_file.empty()) {
    FLATSHARD_RETURN_IF_ERROR(tls::CheckCertificates(tls.root_certs, "--tls_ca_file"));
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsOptions& tls, const TlsFiles* files) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (files != nullptr) {
    // The watched file holds the key, then the chain: gRPC reads each from it.
    auto watcher = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        files->watched_path(), files->watched_path(),
        static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(tls.reload_interval))));
    grpc::experimental::TlsServerCredentialsOptions options(watcher);
    options.watch_identity_key_cert_pairs();
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    return grpc::experimental::TlsServerCredentials(options);
  }
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({tls.private_key, tls.cert_chain});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> PeerCredentials(const TlsOptions& tls, const TlsFiles* files) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  if (files != nullptr && files->ca_bundle() != nullptr) return files->ca_bundle()->Credentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.root_certs;  // empty: gRPC's default roots
  return grpc::SslCredentials(options);
}

}  // namespace flatshard::server
