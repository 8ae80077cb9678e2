// PEM certificates, parsed by OpenSSL: whether a text holds only whole ones (a file still
// being written ends in one cut short), whether a key is a certificate's, and when a
// certificate chain expires. Stateless; thread-safe.
//
//   FLATSHARD_RETURN_IF_ERROR(tls::CheckCertificates(bundle, "--tls_ca_file"));
//   FLATSHARD_ASSIGN_OR_RETURN(absl::Time expires, tls::CertificateChainExpiry(chain));
#ifndef FLATSHARD_TLS_CERTIFICATES_H_
#define FLATSHARD_TLS_CERTIFICATES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flatshard::tls {

// InvalidArgument naming `what` (where the text came from) unless `pem` holds a
// certificate and every certificate it begins parses.
[[nodiscard]] absl::Status CheckCertificates(const std::string& pem, absl::string_view what);

// OK if `private_key` (PEM, unencrypted) is the key of the first certificate of
// `cert_chain`; otherwise InvalidArgument naming `key_what` and `chain_what` (where each
// came from). Precondition: CheckCertificates(cert_chain) is OK.
[[nodiscard]] absl::Status CheckKeyPair(const std::string& cert_chain, absl::string_view chain_what,
                                        const std::string& private_key, absl::string_view key_what);

// When the first certificate of `cert_chain` to expire does (the earliest notAfter of
// the chain: the leaf or an intermediate). InvalidArgument if a certificate does not parse.
[[nodiscard]] absl::StatusOr<absl::Time> CertificateChainExpiry(const std::string& cert_chain);

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_CERTIFICATES_H_
