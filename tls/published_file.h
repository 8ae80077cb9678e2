// PublishedFile: a file of this process (a memfd: what it holds never reaches a disk)
// that other code reads by path() (/proc/self/fd/N), as gRPC's certificate file watchers
// do. Publish replaces its content in one step (dup2), with a later whole-second
// modification time each time, so that a reader across a replacement (gRPC's watcher
// compares times before and after reading) sees the time change and reads again.
// Thread-compatible: one Publish at a time.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto file, PublishedFile::Create(pem));
//   FileWatcherCertificateProvider provider(file->path(), seconds);
//   FLATSHARD_RETURN_IF_ERROR(file->Publish(renewed_pem));
#ifndef FLATSHARD_TLS_PUBLISHED_FILE_H_
#define FLATSHARD_TLS_PUBLISHED_FILE_H_

#include <ctime>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace flatshard::tls {

class PublishedFile {
 public:
  // A file holding `text`. Internal when it cannot be made; FailedPrecondition when it
  // cannot be read back by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PublishedFile>> Create(const std::string& text);
  ~PublishedFile();
  PublishedFile(const PublishedFile&) = delete;
  PublishedFile& operator=(const PublishedFile&) = delete;

  const std::string& path() const { return path_; }
  // Replaces the content with `text`, modified later than any content before.
  [[nodiscard]] absl::Status Publish(const std::string& text);

 private:
  explicit PublishedFile(int fd);

  const int fd_;  // its number stays; the file behind it is replaced
  const std::string path_;
  time_t modified_ = 0;
};

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_PUBLISHED_FILE_H_
