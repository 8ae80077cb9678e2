// KeyPair: a certificate chain and its private key, read from their two files and kept
// current: Reload() reads both again and takes them only if they make an identity a
// TLS peer would accept (tls::CheckIdentity: every certificate parses, the key is the
// certificate's, none has expired). A pair that does not (one file replaced before the
// other, a wrong key, a chain cut short or expired) is ignored, and the last good pair
// stays. The pair taken is published in a file of this process (tls/published_file.h:
// the key never lands on a disk), the key then the chain, which gRPC's certificate
// watchers read (watched_path() as both the key and the certificate file): gRPC 1.51's
// watcher does not check that a key and certificate go together, which is why it never
// reads the operator's files.
//
// Its owner calls Reload (tls/reloader.h), one call at a time; the rest is thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto pair, KeyPair::Start(cert, "--tls_cert_file", key, "--tls_key_file"));
//   FileWatcherCertificateProvider provider(pair->watched_path(), pair->watched_path(), seconds);
#ifndef FLATSHARD_TLS_KEY_PAIR_H_
#define FLATSHARD_TLS_KEY_PAIR_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tls/published_file.h"

namespace flatshard::tls {

class KeyPair {
 public:
  struct Pem {
    std::string cert_chain;
    std::string private_key;
    absl::Time expiry;  // the chain's earliest notAfter
  };
  // The files' pair, if it makes an identity (tls::CheckIdentity); InvalidArgument naming
  // `cert_what` or `key_what` (the flags or options that named them) otherwise, or when
  // one cannot be read.
  [[nodiscard]] static absl::StatusOr<Pem> Read(const std::string& cert_file, const std::string& cert_what,
                                                const std::string& key_file, const std::string& key_what);

  // Reads both files. InvalidArgument naming `cert_what` or `key_what` (the flags or
  // options that named them) when one cannot be read or they make no identity;
  // FailedPrecondition when the published file cannot be read by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KeyPair>> Start(const std::string& cert_file,
                                                                     const std::string& cert_what,
                                                                     const std::string& key_file,
                                                                     const std::string& key_what);
  KeyPair(const KeyPair&) = delete;
  KeyPair& operator=(const KeyPair&) = delete;

  const std::string& cert_file() const { return cert_file_; }
  const std::string& watched_path() const { return published_->path(); }
  Pem current() const;
  // Reads the files again: whether the pair in use changed, or why the files were not
  // taken (InvalidArgument, the error of `accept` when it refuses a new pair, or Internal
  // if they could not be published).
  absl::StatusOr<bool> Reload(const std::function<absl::Status(const Pem&)>& accept = nullptr);

 private:
  KeyPair(std::string cert_file, std::string cert_what, std::string key_file, std::string key_what, Pem pem,
          std::unique_ptr<PublishedFile> published);

  const std::string cert_file_;
  const std::string cert_what_;
  const std::string key_file_;
  const std::string key_what_;
  mutable absl::Mutex mu_;
  Pem current_ ABSL_GUARDED_BY(mu_);
  const std::unique_ptr<PublishedFile> published_;  // Publish under mu_
};

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_KEY_PAIR_H_
