// CaBundle: the CA bundle of a file, kept current without a restart. Reload() reads the
// file again and takes a bundle whose every certificate parses (tls/certificates.h); a
// file that cannot be read or does not parse (one still being written) is ignored, and
// the last good bundle stays. The bundle taken is published in a file of this process
// (tls/published_file.h) that gRPC's certificate watchers read (watched_path();
// tls/credentials.h makes channel credentials over it), so the handshakes that follow
// check against it: connections already open carry on. gRPC's watcher does not check
// what it reads (a missing or half-written file fails every handshake), which is why it
// never reads the operator's file.
//
// Its owner calls Reload (tls/reloader.h), one call at a time; the rest is thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto bundle, CaBundle::Start(path, "tls_ca_file"));
//   Reloader reloader(absl::Minutes(5), [&] { (void)bundle->Reload(); });
#ifndef FLATSHARD_TLS_CA_BUNDLE_H_
#define FLATSHARD_TLS_CA_BUNDLE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tls/published_file.h"

namespace flatshard::tls {

// `file`'s bundle, if every certificate of it parses; InvalidArgument naming `what` (the
// flag or option that named the file) otherwise.
[[nodiscard]] absl::StatusOr<std::string> ReadCaBundle(const std::string& file, const std::string& what);

class CaBundle {
 public:
  // Reads `file`. InvalidArgument naming `what` (the flag or option that named the file)
  // when it cannot be read or does not parse; FailedPrecondition when the published
  // file cannot be read by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CaBundle>> Start(const std::string& file,
                                                                      const std::string& what);
  CaBundle(const CaBundle&) = delete;
  CaBundle& operator=(const CaBundle&) = delete;

  const std::string& file() const { return file_; }
  const std::string& watched_path() const { return published_->path(); }
  std::string current() const;  // the PEM text in use
  // Reads the file again: whether the bundle in use changed, or why the file was not
  // taken (InvalidArgument, the error of `accept` when it refuses a new bundle's PEM
  // text, or Internal if it could not be published).
  absl::StatusOr<bool> Reload(const std::function<absl::Status(const std::string&)>& accept = nullptr);

 private:
  CaBundle(std::string file, std::string what, std::string pem, std::unique_ptr<PublishedFile> published);

  const std::string file_;
  const std::string what_;
  mutable absl::Mutex mu_;
  std::string current_ ABSL_GUARDED_BY(mu_);
  const std::unique_ptr<PublishedFile> published_;  // Publish under mu_
};

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_CA_BUNDLE_H_
