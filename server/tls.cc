#include "server/tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <ctime>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"
#include "server/tls_files.h"

namespace flatshard::server {
namespace {

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using Cert = std::unique_ptr<X509, X509Free>;

std::unique_ptr<BIO, BioFree> Read(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first PEM certificate of `pem`, or null.
Cert FirstCertificate(const std::string& pem) {
  auto bio = Read(pem);
  return Cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
}

// InvalidArgument naming `flag` unless `pem` holds a certificate and every certificate
// it begins parses (a file cut short, as one still being written is, ends in one that
// does not).
absl::Status CheckCertificates(const std::string& pem, absl::string_view flag) {
  constexpr std::string_view kBegin = "-----BEGIN CERTIFICATE-----";
  int begun = 0;
  for (size_t at = pem.find(kBegin); at != std::string::npos; at = pem.find(kBegin, at + kBegin.size())) ++begun;
  int parsed = 0;
  if (auto bio = Read(pem)) {
    while (Cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) != nullptr) ++parsed;
  }
  ERR_clear_error();  // the end of the text, or the certificate that did not parse
  if (begun == 0) return absl::InvalidArgumentError(absl::StrCat(flag, " holds no PEM certificate"));
  if (parsed < begun) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": certificate ", parsed + 1, " of ", begun,
                                                   " does not parse (a file cut short?)"));
  }
  return absl::OkStatus();
}

// How often gRPC's watchers read TlsFiles' files: as often as those are read.
unsigned int ReloadSeconds(const TlsOptions& tls) {
  return static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(tls.reload_interval)));
}

}  // namespace

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
  FLATSHARD_RETURN_IF_ERROR(CheckCertificates(tls.cert_chain, "--tls_cert_file"));
  const Cert cert = FirstCertificate(tls.cert_chain);
  auto key_bio = Read(tls.private_key);
  const std::unique_ptr<EVP_PKEY, KeyFree> key(
      key_bio ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (key == nullptr) {
    return absl::InvalidArgumentError("--tls_key_file holds no unencrypted PEM private key");
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return absl::InvalidArgumentError(
        "--tls_key_file is not the private key of the certificate in --tls_cert_file");
  }
  if (!tls.root_certs.empty() || !tls.ca_file.empty()) {
    FLATSHARD_RETURN_IF_ERROR(CheckCertificates(tls.root_certs, "--tls_ca_file"));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Time> CertificateChainExpiry(const std::string& cert_chain) {
  FLATSHARD_RETURN_IF_ERROR(CheckCertificates(cert_chain, "the certificate chain"));
  absl::Time earliest = absl::InfiniteFuture();
  auto bio = Read(cert_chain);
  while (const Cert cert{bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr}) {
    tm expires{};
    if (ASN1_TIME_to_tm(X509_get0_notAfter(cert.get()), &expires) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError("a certificate of the chain has no valid expiry date");
    }
    earliest = std::min(earliest, absl::FromTM(expires, absl::UTCTimeZone()));
  }
  ERR_clear_error();  // the end of the chain reads as an error
  return earliest;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsOptions& tls, const TlsFiles* files) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (files != nullptr) {
    // The watched file holds the key, then the chain: gRPC reads each from it.
    auto watcher = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        files->watched_path(), files->watched_path(), ReloadSeconds(tls));
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
  if (files != nullptr && !files->watched_roots_path().empty()) {
    auto watcher = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        files->watched_roots_path(), ReloadSeconds(tls));
    grpc::experimental::TlsChannelCredentialsOptions options;
    options.set_certificate_provider(watcher);
    options.watch_root_certs();
    options.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
    return grpc::experimental::TlsCredentials(options);
  }
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.root_certs;  // empty: gRPC's default roots
  return grpc::SslCredentials(options);
}

}  // namespace flatshard::server
