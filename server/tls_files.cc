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

// `current` with its pair, then its CA bundle, replaced by what their files (`tls`'s)
// hold now where that is valid (ValidateTls); a file that cannot be read changes nothing.
TlsOptions ReadAgain(const TlsOptions& tls, TlsOptions current) {
  const absl::StatusOr<std::string> chain = ReadFileToString(tls.cert_file);
  const absl::StatusOr<std::string> key = ReadFileToString(tls.key_file);
  if (chain.ok() && key.ok()) {
    TlsOptions read = current;
    read.cert_chain = *chain;
    read.private_key = *key;
    if (ValidateTls(read).ok()) current = std::move(read);
  }
  if (tls.ca_file.empty()) return current;
  if (absl::StatusOr<std::string> roots = ReadFileToString(tls.ca_file); roots.ok()) {
    TlsOptions read = current;
    read.root_certs = *std::move(roots);
    if (ValidateTls(read).ok()) current = std::move(read);
  }
  return current;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Start(const TlsOptions& tls) {
  Watched made[2];
  for (int i = 0; i < (tls.ca_file.empty() ? 1 : 2); ++i) {
    made[i].fd = memfd_create("flatshard-tls", MFD_CLOEXEC);
    if (made[i].fd < 0) {
      if (i == 1) close(made[0].fd);
      return ErrnoError("memfd_create for the TLS files");
    }
    made[i].path = absl::StrCat("/proc/self/fd/", made[i].fd);
  }
  std::unique_ptr<TlsFiles> files(new TlsFiles(tls, made[0], made[1]));
  {
    absl::MutexLock lock(&files->mu_);
    FLATSHARD_RETURN_IF_ERROR(files->Publish(files->pair_, tls.private_key + "\n" + tls.cert_chain));
    if (!tls.ca_file.empty()) FLATSHARD_RETURN_IF_ERROR(files->Publish(files->roots_, tls.root_certs));
  }
  // gRPC reads them by path, through /proc.
  const std::string watched = files->watched_path();
  if (absl::StatusOr<std::string> back = ReadFileToString(watched); !back.ok() || back->empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--tls_reload_interval: cannot read back ", watched, " (is /proc mounted?); 0 turns reloads off"));
  }
  files->reloader_ = std::thread([files = files.get()] {
    while (!files->stopping_.WaitForNotificationWithTimeout(files->initial_.reload_interval)) files->Reload();
  });
  return files;
}

TlsFiles::TlsFiles(const TlsOptions& tls, Watched pair, Watched roots)
    : initial_(tls), pair_(std::move(pair)), roots_(std::move(roots)), current_(tls) {}

TlsFiles::~TlsFiles() {
  stopping_.Notify();
  if (reloader_.joinable()) reloader_.join();
  for (const Watched* file : {&pair_, &roots_}) {
    if (file->fd >= 0) close(file->fd);
  }
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
  const TlsOptions read = ReadAgain(initial_, current());
  absl::MutexLock lock(&mu_);
  bool changed = false;
  if ((read.cert_chain != current_.cert_chain || read.private_key != current_.private_key) &&
      Publish(pair_, read.private_key + "\n" + read.cert_chain).ok()) {
    current_.cert_chain = read.cert_chain;
    current_.private_key = read.private_key;
    changed = true;
  }
  if (read.root_certs != current_.root_certs && Publish(roots_, read.root_certs).ok()) {
    current_.root_certs = read.root_certs;
    changed = true;
  }
  if (changed) ++generation_;
  return changed;
}

absl::Status TlsFiles::Publish(const Watched& file, const std::string& text) {
  const int fresh = memfd_create("flatshard-tls", MFD_CLOEXEC);
  if (fresh < 0) return ErrnoError("memfd_create for the TLS files");
  // A later modification time than the file it replaces, at whole seconds (what a
  // watcher compares), so that one reading across the replacement reads again.
  modified_ = std::max(modified_ + 1, time(nullptr));
  const timespec times[2] = {{0, UTIME_OMIT}, {modified_, 0}};
  const bool written = write(fresh, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                       futimens(fresh, times) == 0 && dup2(fresh, file.fd) == file.fd;
  const absl::Status status = written ? absl::OkStatus() : ErrnoError("writing the TLS files");
  close(fresh);
  return status;
}

}  // namespace flatshard::server
