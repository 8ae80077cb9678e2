// CaBundle: the CA bundle of a file, kept current without a restart, and TLS channel
// credentials that check peers against it. Reload() reads the file again and takes a
// bundle whose every certificate parses (tls/certificates.h); a file that cannot be read
// or does not parse (one still being written) is ignored, and the last good bundle
// stays. The bundle taken is published in a file of this process (tls/published_file.h)
// that the credentials' gRPC watcher reads every `interval`, so the handshakes that
// follow check against it: connections already open carry on. gRPC's watcher does not
// check what it reads (a missing or half-written file fails every handshake), which is
// why it never reads the operator's file.
//
// With `reload_itself`, a thread of its own reloads every `interval`; without, its owner
// calls Reload (the server's TlsFiles, which reloads its certificate at the same time).
// Thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto bundle, CaBundle::Start(path, "tls_ca_file", absl::Minutes(5), true));
//   auto channel = grpc::CreateChannel(address, bundle->Credentials());  // outlived by `bundle`
#ifndef FLATSHARD_TLS_CA_BUNDLE_H_
#define FLATSHARD_TLS_CA_BUNDLE_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tls/published_file.h"

namespace grpc {
class ChannelCredentials;
}  // namespace grpc

namespace flatshard::tls {

// `file`'s bundle, if every certificate of it parses; InvalidArgument naming `what` (the
// flag or option that named the file) otherwise.
[[nodiscard]] absl::StatusOr<std::string> ReadCaBundle(const std::string& file, const std::string& what);

class CaBundle {
 public:
  // Reads `file`. InvalidArgument naming `what` (the flag or option that named the file)
  // when it cannot be read or does not parse; FailedPrecondition when the published
  // file cannot be read by its path (no /proc). Precondition: interval > 0.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CaBundle>> Start(const std::string& file,
                                                                      const std::string& what,
                                                                      absl::Duration interval, bool reload_itself);
  ~CaBundle();  // stops the thread
  CaBundle(const CaBundle&) = delete;
  CaBundle& operator=(const CaBundle&) = delete;

  const std::string& file() const { return file_; }
  std::string current() const;  // the PEM text in use
  // Reads the file again: whether the bundle in use changed, or why the file was not
  // taken (InvalidArgument, or Internal if it could not be published).
  absl::StatusOr<bool> Reload();
  // Credentials that check the host name a peer is dialed by against its certificate,
  // and the certificate against the bundle of the moment.
  std::shared_ptr<grpc::ChannelCredentials> Credentials() const;

 private:
  CaBundle(std::string file, std::string what, absl::Duration interval, std::string pem,
           std::unique_ptr<PublishedFile> published);

  const std::string file_;
  const std::string what_;
  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  std::string current_ ABSL_GUARDED_BY(mu_);
  const std::unique_ptr<PublishedFile> published_;  // Publish under mu_
  absl::Notification stopping_;
  std::thread reloader_;
};

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_CA_BUNDLE_H_
