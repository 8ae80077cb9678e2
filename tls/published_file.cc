#include "tls/published_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "core/status_macros.h"

namespace flatshard::tls {
namespace {

absl::Status ErrnoError(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PublishedFile>> PublishedFile::Create(const std::string& text) {
  const int fd = memfd_create("flatshard-tls", MFD_CLOEXEC);
  if (fd < 0) return ErrnoError("memfd_create for a TLS file");
  std::unique_ptr<PublishedFile> file(new PublishedFile(fd));
  FLATSHARD_RETURN_IF_ERROR(file->Publish(text));
  if (absl::StatusOr<std::string> back = ReadFileToString(file->path()); !back.ok() || *back != text) {
    return absl::FailedPreconditionError(absl::StrCat("cannot read back ", file->path(), " (is /proc mounted?)"));
  }
  return file;
}

PublishedFile::PublishedFile(int fd) : fd_(fd), path_(absl::StrCat("/proc/self/fd/", fd)) {}

PublishedFile::~PublishedFile() { close(fd_); }

absl::Status PublishedFile::Publish(const std::string& text) {
  const int fresh = memfd_create("flatshard-tls", MFD_CLOEXEC);
  if (fresh < 0) return ErrnoError("memfd_create for a TLS file");
  // Whole seconds: what a watcher compares.
  modified_ = std::max(modified_ + 1, time(nullptr));
  const timespec times[2] = {{0, UTIME_OMIT}, {modified_, 0}};
  const bool written = write(fresh, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                       futimens(fresh, times) == 0 && dup2(fresh, fd_) == fd_;
  const absl::Status status = written ? absl::OkStatus() : ErrnoError("writing a TLS file");
  close(fresh);
  return status;
}

}  // namespace flatshard::tls
