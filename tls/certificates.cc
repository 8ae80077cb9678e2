#include "tls/certificates.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <ctime>
#include <memory>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"

namespace flatshard::tls {
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
struct StoreFree {
  void operator()(X509_STORE* store) const { X509_STORE_free(store); }
};
struct StoreContextFree {
  void operator()(X509_STORE_CTX* context) const { X509_STORE_CTX_free(context); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * certs) const { sk_X509_pop_free(certs, X509_free); }
};
using Cert = std::unique_ptr<X509, X509Free>;

std::unique_ptr<BIO, BioFree> Read(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Each certificate of `pem` in turn, until one does not parse or the text ends.
class Certificates {
 public:
  explicit Certificates(const std::string& pem) : bio_(Read(pem)) {}
  ~Certificates() { ERR_clear_error(); }  // the end of the text reads as an error
  Cert Next() { return Cert(bio_ ? PEM_read_bio_X509(bio_.get(), nullptr, nullptr, nullptr) : nullptr); }

 private:
  std::unique_ptr<BIO, BioFree> bio_;
};

// Whether the last line of `pem` is `begin` cut short ("-----BEGIN CERT"): a file cut
// there holds one certificate more than its whole BEGIN lines say.
bool EndsInACutLine(std::string_view pem, std::string_view begin) {
  const size_t end = pem.find_last_not_of(" \t\r\n");
  if (end == std::string_view::npos) return false;
  const std::string_view text = pem.substr(0, end + 1);
  const size_t newline = text.rfind('\n');
  const std::string_view last = newline == std::string_view::npos ? text : text.substr(newline + 1);
  return last.size() < begin.size() && begin.starts_with(last);
}

}  // namespace

absl::Status CheckCertificates(const std::string& pem, absl::string_view what) {
  constexpr std::string_view kBegin = "-----BEGIN CERTIFICATE-----";
  int begun = EndsInACutLine(pem, kBegin) ? 1 : 0;
  for (size_t at = pem.find(kBegin); at != std::string::npos; at = pem.find(kBegin, at + kBegin.size())) ++begun;
  int parsed = 0;
  {
    Certificates certificates(pem);
    while (certificates.Next() != nullptr) ++parsed;
  }
  if (begun == 0) return absl::InvalidArgumentError(absl::StrCat(what, " holds no PEM certificate"));
  if (parsed < begun) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": certificate ", parsed + 1, " of ", begun,
                                                   " does not parse (a file cut short?)"));
  }
  return absl::OkStatus();
}

absl::Status CheckKeyPair(const std::string& cert_chain, absl::string_view chain_what,
                          const std::string& private_key, absl::string_view key_what) {
  const Cert cert = Certificates(cert_chain).Next();
  auto bio = Read(private_key);
  const std::unique_ptr<EVP_PKEY, KeyFree> key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr)
                                                   : nullptr);
  ERR_clear_error();
  if (key == nullptr) return absl::InvalidArgumentError(absl::StrCat(key_what, " holds no unencrypted PEM private key"));
  if (cert == nullptr || X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(key_what, " is not the private key of the certificate in ", chain_what));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Time> CertificateChainExpiry(const std::string& cert_chain) {
  FLATSHARD_RETURN_IF_ERROR(CheckCertificates(cert_chain, "the certificate chain"));
  absl::Time earliest = absl::InfiniteFuture();
  Certificates certificates(cert_chain);
  while (const Cert cert = certificates.Next()) {
    tm expires{};
    if (ASN1_TIME_to_tm(X509_get0_notAfter(cert.get()), &expires) != 1) {
      return absl::InvalidArgumentError("a certificate of the chain has no valid expiry date");
    }
    earliest = std::min(earliest, absl::FromTM(expires, absl::UTCTimeZone()));
  }
  return earliest;
}

absl::StatusOr<absl::Time> CheckIdentity(const std::string& cert_chain, absl::string_view chain_what,
                                         const std::string& private_key, absl::string_view key_what) {
  FLATSHARD_RETURN_IF_ERROR(CheckCertificates(cert_chain, chain_what));
  FLATSHARD_RETURN_IF_ERROR(CheckKeyPair(cert_chain, chain_what, private_key, key_what));
  FLATSHARD_ASSIGN_OR_RETURN(const absl::Time expiry, CertificateChainExpiry(cert_chain));
  if (expiry <= absl::Now()) {
    return absl::InvalidArgumentError(
        absl::StrCat(chain_what, ": a certificate of the chain expired ",
                     absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", expiry, absl::UTCTimeZone()),
                     ": no client or peer would accept it"));
  }
  return expiry;
}

absl::Status CheckClientUse(const std::string& cert_chain, absl::string_view what) {
  const Cert cert = Certificates(cert_chain).Next();
  // X509_PURPOSE_SSL_CLIENT: the purpose a TLS server verifies a client's certificate for.
  const bool usable = cert != nullptr && X509_check_purpose(cert.get(), X509_PURPOSE_SSL_CLIENT, 0) == 1;
  ERR_clear_error();
  if (!usable) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the certificate may not prove a TLS client (its extendedKeyUsage lacks clientAuth): servers that "
              "ask for client certificates refuse it"));
  }
  return absl::OkStatus();
}

absl::Status CheckClientCertificate(const std::string& cert_chain, absl::string_view chain_what,
                                    const std::string& roots, absl::string_view roots_what) {
  const std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  Certificates cas(roots);
  while (const Cert ca = cas.Next()) X509_STORE_add_cert(store.get(), ca.get());  // takes a reference
  Certificates chain(cert_chain);
  const Cert leaf = chain.Next();
  const std::unique_ptr<STACK_OF(X509), StackFree> intermediates(sk_X509_new_null());
  while (Cert intermediate = chain.Next()) sk_X509_push(intermediates.get(), intermediate.release());
  const std::unique_ptr<X509_STORE_CTX, StoreContextFree> context(X509_STORE_CTX_new());
  int verified = 0;
  int error = X509_V_ERR_UNSPECIFIED;
  if (store && leaf && intermediates && context &&
      X509_STORE_CTX_init(context.get(), store.get(), leaf.get(), intermediates.get()) == 1 &&
      X509_STORE_CTX_set_default(context.get(), "ssl_client") == 1) {  // what a TLS server checks
    verified = X509_verify_cert(context.get());
    error = X509_STORE_CTX_get_error(context.get());
  }
  ERR_clear_error();
  if (verified != 1) {
    return absl::InvalidArgumentError(absl::StrCat(chain_what, ": the certificate does not verify as a TLS client's "
                                                   "against ", roots_what, " (", X509_verify_cert_error_string(error),
                                                   ")"));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::tls
