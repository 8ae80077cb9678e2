// PEM certificates, parsed by OpenSSL: whether a text holds only whole ones (a file still
// being written ends in one cut short), whether a key is a certificate's, when a
// certificate chain expires, and whether a certificate may prove a TLS client. Stateless;
// thread-safe.
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
// certificate and every certificate it begins parses (a text that ends inside a BEGIN
// line begins one more).
[[nodiscard]] absl::Status CheckCertificates(const std::string& pem, absl::string_view what);

// OK if `private_key` (PEM, unencrypted) is the key of the first certificate of
// `cert_chain`; otherwise InvalidArgument naming `key_what` and `chain_what` (where each
// came from). Precondition: CheckCertificates(cert_chain) is OK.
[[nodiscard]] absl::Status CheckKeyPair(const std::string& cert_chain, absl::string_view chain_what,
                                        const std::string& private_key, absl::string_view key_what);

// When the first certificate of `cert_chain` to expire does (the earliest notAfter of
// the chain: the leaf or an intermediate). InvalidArgument if a certificate does not parse.
[[nodiscard]] absl::StatusOr<absl::Time> CertificateChainExpiry(const std::string& cert_chain);

// The chain's expiry if `cert_chain` and `private_key` make an identity a TLS peer would
// take: every certificate parses, the key is the first certificate's, and none has
// expired. Otherwise InvalidArgument naming `chain_what` or `key_what`.
[[nodiscard]] absl::StatusOr<absl::Time> CheckIdentity(const std::string& cert_chain, absl::string_view chain_what,
                                                       const std::string& private_key, absl::string_view key_what);

// OK if the first certificate of `cert_chain` may prove a TLS client (its extended key
// usage names clientAuth, or it has none); otherwise InvalidArgument naming `what`: a
// server that asks for client certificates would refuse it, whoever signed it.
// Precondition: CheckCertificates(cert_chain) is OK.
[[nodiscard]] absl::Status CheckClientUse(const std::string& cert_chain, absl::string_view what);

// OK if the first certificate of `cert_chain` (with the rest of the chain as its
// intermediates) verifies against the CAs of `roots` as a TLS client's, as a server that
// asks for client certificates checks it: signed by one of them, in its validity period,
// and an extended key usage that names clientAuth or none. Otherwise InvalidArgument
// naming `chain_what` and `roots_what` and OpenSSL's reason. Precondition:
// CheckCertificates holds for both.
[[nodiscard]] absl::Status CheckClientCertificate(const std::string& cert_chain, absl::string_view chain_what,
                                                  const std::string& roots, absl::string_view roots_what);

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_CERTIFICATES_H_
