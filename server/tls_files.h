// TlsFiles: the certificate chain and key a TLS server presents, and the CA bundle it
// checks its peers against, kept current from the files it was given
// (TlsOptions::cert_file, key_file, ca_file) without a restart. Every reload_interval a
// thread reads them again. A new pair that goes together (ValidateTls) becomes the
// current one; a pair that does not (one file replaced before the other, a wrong key, a
// chain cut short) is ignored, and the last good pair stays. The CA bundle is a
// tls::CaBundle (tls/ca_bundle.h: a new one is taken when every certificate of it
// parses), taken independently of the pair.
//
// The control plane's gRPC file watcher reads watched_path(): a file of this process
// (tls/published_file.h, so the key is never written anywhere else) holding the current
// key then chain. gRPC 1.51's watcher does not check that a key and certificate go
// together, which is why it reads no operator file directly. The metrics endpoint's
// relay takes current() when generation() moves.
//
// What it takes is logged (spdlog), and why it did not take files, once per reason.
//
// Thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto files, TlsFiles::Start(tls));  // tls.reloads()
//   builder.AddListeningPort(address, ServerCredentials(tls, files.get()), &port);
//   PeerClient peers(cluster, rank, token, PeerCredentials(tls, files.get()));
#ifndef FLATSHARD_SERVER_TLS_FILES_H_
#define FLATSHARD_SERVER_TLS_FILES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/tls.h"
#include "tls/ca_bundle.h"
#include "tls/published_file.h"

namespace flatshard::server {

class TlsFiles {
 public:
  // Precondition: tls.reloads(). InvalidArgument for a CA file that does not parse,
  // Internal when a watched file cannot be made, FailedPrecondition when it cannot be
  // read by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TlsFiles>> Start(const TlsOptions& tls);
  ~TlsFiles();  // stops the thread
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  const std::string& watched_path() const { return pair_->path(); }
  // The CA bundle of tls.ca_file; null without one (the peers are checked against the
  // system's roots).
  const tls::CaBundle* ca_bundle() const { return roots_.get(); }
  // The pair and CA bundle in use, and how many times they have changed.
  TlsOptions current() const;
  uint64_t generation() const;
  // When the pair in use expires: its chain's earliest notAfter.
  absl::Time expiry() const;
  // Reads the files now (the thread does it every interval): whether anything changed.
  bool Reload();

 private:
  TlsFiles(const TlsOptions& tls, std::unique_ptr<tls::PublishedFile> pair, std::unique_ptr<tls::CaBundle> roots);

  const TlsOptions initial_;
  const std::unique_ptr<tls::PublishedFile> pair_;  // the key, then the chain; published under mu_
  const std::unique_ptr<tls::CaBundle> roots_;
  mutable absl::Mutex mu_;
  TlsOptions current_ ABSL_GUARDED_BY(mu_);  // its root_certs are roots_'
  absl::Time expiry_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_refused_ ABSL_GUARDED_BY(mu_);  // why the last read's files were not taken
  absl::Notification stopping_;
  std::thread reloader_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_TLS_FILES_H_
