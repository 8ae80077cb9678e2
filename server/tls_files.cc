#include "server/tls_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/file.h"
#include "core/status_macros.h"

namespace flatshard::server {
namespace {

absl::Status ErrnoError(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// `tls` with cert_chain and private_key as its files hold them now. InvalidArgument (as
// ValidateTls) for a pair that does not go together, Unavailable for a file that cannot
// be read.
absl::StatusOr<TlsOptions> ReadAgain(const TlsOptions& tls) {
  TlsOptions read = tls;
  for (const auto& [path, pem] : {std::pair{&tls.cert_file, &read.cert_chain},
                                  std::pair{&tls.key_file, &read.private_key}}) {
    absl::StatusOr<std::string> text = ReadFileToString(*path);
    if (!text.ok()) return absl::UnavailableError(absl::StrCat("cannot read ", *path, ": ", text.status().message()));
    *pem = *std::move(text);
  }
  FLATSHARD_RETURN_IF_ERROR(ValidateTls(read));
  return read;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Start(const TlsOptions& tls) {
  const int fd = memfd_create("flatshard-tls", MFD_CLOEXEC);
  if (fd < 0) return ErrnoError("memfd_create for the TLS files");
  std::unique_ptr<TlsFiles> files(new TlsFiles(tls, fd));
  {
    absl::MutexLock lock(&files->mu_);
    FLATSHARD_RETURN_IF_ERROR(files->Publish(tls));
  }
  // gRPC reads it by path, through /proc.
  if (absl::StatusOr<std::string> back = ReadFileToString(files->watched_path()); !back.ok() || back->empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--tls_reload_interval: cannot read back ", files->watched_path(), " (is /proc mounted?); 0 turns reloads off"));
  }
  files->reloader_ = std::thread([files = files.get()] {
    while (!files->stopping_.WaitForNotificationWithTimeout(files->initial_.reload_interval)) files->Reload();
  });
  return files;
}

TlsFiles::TlsFiles(const TlsOptions& tls, int fd)
    : initial_(tls), fd_(fd), watched_path_(absl::StrCat("/proc/self/fd/", fd)), current_(tls) {}

TlsFiles::~TlsFiles() {
  stopping_.Notify();
  if (reloader_.joinable()) reloader_.join();
  close(fd_);
}

TlsOptions TlsFiles::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

uint64_t TlsFiles::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

bool TlsFiles::Reload() {
  absl::StatusOr<TlsOptions> read = ReadAgain(initial_);  // Unavailable or InvalidArgument: keep the last pair
  if (!read.ok()) return false;
  absl::MutexLock lock(&mu_);
  if (read->cert_chain == current_.cert_chain && read->private_key == current_.private_key) return false;
  if (!Publish(*read).ok()) return false;
  current_ = *std::move(read);
  ++generation_;
  return true;
}

absl::Status TlsFiles::Publish(const TlsOptions& tls) {
  const int fresh = memfd_create("flatshard-tls", MFD_CLOEXEC);
  if (fresh < 0) return ErrnoError("memfd_create for the TLS files");
  const std::string pem = tls.private_key + "\n" + tls.cert_chain;
  // A later modification time than the file it replaces, at whole seconds (what a
  // watcher compares), so that one reading across the replacement reads again.
  modified_ = std::max(modified_ + 1, time(nullptr));
  const timespec times[2] = {{0, UTIME_OMIT}, {modified_, 0}};
  const bool written = write(fresh, pem.data(), pem.size()) == static_cast<ssize_t>(pem.size()) &&
                       futimens(fresh, times) == 0 && dup2(fresh, fd_) == fd_;
  const absl::Status status = written ? absl::OkStatus() : ErrnoError("writing the TLS files");
  close(fresh);
  return status;
}

}  // namespace flatshard::server
