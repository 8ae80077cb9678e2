// TlsFiles: the certificate chain and key a TLS server presents, kept current from the
// files it was given (TlsOptions::cert_file, key_file) without a restart. Every
// reload_interval a thread reads them again: a new pair that goes together (ValidateTls)
// becomes the current one; a pair that does not (one file replaced before the other, a
// wrong key) is ignored, and the last good pair stays.
//
// The control plane's gRPC file watcher reads watched_path(): a file of this process
// (a memfd, so the key is never written anywhere else) holding the current key then
// chain, replaced in one step (dup2) with a later modification time each time, so that
// a watcher reading it in the middle of a replacement sees the time change and reads
// again. gRPC 1.51's watcher does not check that a key and certificate go together
// itself, which is why it reads no operator file directly. The metrics endpoint's relay
// takes current() when generation() moves.
//
// Thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto files, TlsFiles::Start(tls));  // tls.reloads()
//   builder.AddListeningPort(address, ServerCredentials(tls, files.get()), &port);
#ifndef FLATSHARD_SERVER_TLS_FILES_H_
#define FLATSHARD_SERVER_TLS_FILES_H_

#include <cstdint>
#include <ctime>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/tls.h"

namespace flatshard::server {

class TlsFiles {
 public:
  // Precondition: tls.reloads() and ValidateTls(tls) is OK. Internal when the watched
  // file cannot be made, FailedPrecondition when it cannot be read by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TlsFiles>> Start(const TlsOptions& tls);
  ~TlsFiles();  // stops the thread; the watched file goes with the process's descriptor
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  const std::string& watched_path() const { return watched_path_; }
  // The pair in use, and how many times it has changed.
  TlsOptions current() const;
  uint64_t generation() const;
  // Reads the files now (the thread does it every interval): whether the pair changed.
  bool Reload();

 private:
  TlsFiles(const TlsOptions& tls, int fd);
  // Puts `tls`'s key and chain into the watched file, modified after the last time.
  absl::Status Publish(const TlsOptions& tls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TlsOptions initial_;
  const int fd_;  // the watched file's descriptor; its content is replaced, the number stays
  const std::string watched_path_;
  mutable absl::Mutex mu_;
  TlsOptions current_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  time_t modified_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification stopping_;
  std::thread reloader_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_TLS_FILES_H_
