#include "server/tls_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace flatshard::server {
namespace {

absl::Status ErrnoError(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// What the files hold now: `current` with its pair, then its CA bundle, replaced by what
// their files (`tls`'s) hold where that is valid (ValidateTls), and why what was not
// taken was not (a file that cannot be read, or does not validate).
struct ReadBack {
  TlsOptions taken;
  std::vector<std::string> refused;
};

ReadBack ReadAgain(const TlsOptions& tls, TlsOptions current) {
  ReadBack back;
  // `current` with each (file, member) of `files` read into its member, taken if it validates.
  using Member = std::string TlsOptions::*;
  auto take = [&](std::initializer_list<std::pair<const std::string&, Member>> files) {
    TlsOptions read = current;
    for (const auto& [path, pem] : files) {
      absl::StatusOr<std::string> text = ReadFileToString(path);
      if (!text.ok()) {
        back.refused.push_back(absl::StrCat("cannot read ", path, ": ", text.status().message()));
        return;
      }
      read.*pem = *std::move(text);
    }
    if (absl::Status valid = ValidateTls(read); !valid.ok()) {
      back.refused.push_back(std::string(valid.message()));
      return;
    }
    current = std::move(read);
  };
  take({{tls.cert_file, &TlsOptions::cert_chain}, {tls.key_file, &TlsOptions::private_key}});
  if (!tls.ca_file.empty()) take({{tls.ca_file, &TlsOptions::root_certs}});
  back.taken = std::move(current);
  return back;
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
  const ReadBack back = ReadAgain(initial_, current());
  const TlsOptions& read = back.taken;
  absl::MutexLock lock(&mu_);
  // Told once per reason, not every interval while the files stay as they are.
  if (std::string refused = absl::StrJoin(back.refused, "; "); refused != last_refused_) {
    if (!refused.empty()) spdlog::warn("TLS files not taken (the last good ones stay in use): {}", refused);
    last_refused_ = std::move(refused);
  }
  bool changed = false;
  if (read.cert_chain != current_.cert_chain || read.private_key != current_.private_key) {
    if (const absl::Status published = Publish(pair_, read.private_key + "\n" + read.cert_chain); published.ok()) {
      current_.cert_chain = read.cert_chain;
      current_.private_key = read.private_key;
      changed = true;
      const absl::StatusOr<absl::Time> expiry = CertificateChainExpiry(read.cert_chain);
      spdlog::info("TLS: presenting the renewed certificate of {}, which expires {}", initial_.cert_file,
                   expiry.ok() ? absl::FormatTime("%Y-%m-%d %H:%M UTC", *expiry, absl::UTCTimeZone()) : "(unknown)");
    } else {
      spdlog::warn("TLS: the renewed certificate could not be published: {}", std::string(published.message()));
    }
  }
  if (read.root_certs != current_.root_certs) {
    if (const absl::Status published = Publish(roots_, read.root_certs); published.ok()) {
      current_.root_certs = read.root_certs;
      changed = true;
      spdlog::info("TLS: the peers' certificates are checked against the new CA bundle of {}", initial_.ca_file);
    } else {
      spdlog::warn("TLS: the new CA bundle could not be published: {}", std::string(published.message()));
    }
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
