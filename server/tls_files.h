// TlsFiles: the certificate chain and key a TLS server presents, and the CA bundle it
// checks its peers against, kept current from the files it was given
// (TlsOptions::cert_file, key_file, ca_file) without a restart. Every reload_interval a
// thread reads them again. A new pair that goes together (ValidateTls) becomes the
// current one; a pair that does not (one file replaced before the other, a wrong key, a
// chain cut short) is ignored, and the last good pair stays. Likewise a new CA bundle
// whose every certificate parses is taken, and one that does not (half written) is not;
// the two are taken independently of each other.
//
// gRPC's file watchers read watched_path() (the control plane's: the current key then
// chain) and watched_roots_path() (the peer calls': the current CA bundle): files of
// this process (memfds, so the key is never written anywhere else), each replaced in
// one step (dup2) with a later modification time each time, so that a watcher reading
// one in the middle of a replacement sees the time change and reads again. gRPC 1.51's
// watcher does not check that a key and certificate go together, nor that a bundle
// parses, which is why it reads no operator file directly. The metrics endpoint's relay
// takes current() when generation() moves.
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
  // Precondition: tls.reloads(). Internal when a watched file cannot be made,
  // FailedPrecondition when it cannot be read by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TlsFiles>> Start(const TlsOptions& tls);
  ~TlsFiles();  // stops the thread; the watched files go with the process's descriptors
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  const std::string& watched_path() const { return pair_.path; }
  // Empty without a ca_file (the peers are checked against the system's roots).
  const std::string& watched_roots_path() const { return roots_.path; }
  // The pair and CA bundle in use, and how many times they have changed.
  TlsOptions current() const;
  uint64_t generation() const;
  // Reads the files now (the thread does it every interval): whether anything changed.
  bool Reload();

 private:
  // A watched file: its content is replaced, its descriptor number stays.
  struct Watched {
    int fd = -1;
    std::string path;  // /proc/self/fd/<fd>; empty: not watched
  };

  TlsFiles(const TlsOptions& tls, Watched pair, Watched roots);
  // Puts `text` into `file`, modified after the last time any file was.
  absl::Status Publish(const Watched& file, const std::string& text) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TlsOptions initial_;
  const Watched pair_;   // the key, then the chain
  const Watched roots_;  // the CA bundle, with a ca_file
  mutable absl::Mutex mu_;
  TlsOptions current_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  time_t modified_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_refused_ ABSL_GUARDED_BY(mu_);  // why the last read's files were not taken
  absl::Notification stopping_;
  std::thread reloader_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_TLS_FILES_H_
