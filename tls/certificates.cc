#include "tls/certificates.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <ctime>
#include <memory>
#include <string_view>

#include "absl/strings/str_cat.h"
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

}  // namespace

absl::Status CheckCertificates(const std::string& pem, absl::string_view what) {
  constexpr std::string_view kBegin = "-----BEGIN CERTIFICATE-----";
  int begun = 0;
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

}  // namespace flatshard::tls
