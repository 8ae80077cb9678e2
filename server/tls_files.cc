#include "server/tls_files.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"
#include "tls/certificates.h"

namespace flatshard::server {
namespace {

// The key then the chain, as gRPC's watcher reads both from one file.
std::string PairText(const TlsOptions& tls) { return tls.private_key + "\n" + tls.cert_chain; }

// `current` with its pair as its files (`tls`'s) hold it now, if they can be read and go
// together (ValidateTls); otherwise why not.
absl::StatusOr<TlsOptions> ReadPair(const TlsOptions& tls, TlsOptions current) {
  for (const auto& [path, pem] : {std::pair{&tls.cert_file, &current.cert_chain},
                                  std::pair{&tls.key_file, &current.private_key}}) {
    absl::StatusOr<std::string> text = ReadFileToString(*path);
    if (!text.ok()) return absl::UnavailableError(absl::StrCat("cannot read ", *path, ": ", text.status().message()));
    *pem = *std::move(text);
  }
  FLATSHARD_RETURN_IF_ERROR(ValidateTls(current));
  return current;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Start(const TlsOptions& tls) {
  auto hint = [](const absl::Status& status) {  // no /proc: say how to do without
    if (!absl::IsFailedPrecondition(status)) return status;
    return absl::FailedPreconditionError(
        absl::StrCat("--tls_reload_interval: ", status.message(), "; 0 turns reloads off"));
  };
  absl::StatusOr<std::unique_ptr<tls::PublishedFile>> pair = tls::PublishedFile::Create(PairText(tls));
  if (!pair.ok()) return hint(pair.status());
  std::unique_ptr<tls::CaBundle> roots;
  if (!tls.ca_file.empty()) {
    absl::StatusOr<std::unique_ptr<tls::CaBundle>> bundle =
        tls::CaBundle::Start(tls.ca_file, "--tls_ca_file", tls.reload_interval, /*reload_itself=*/false);
    if (!bundle.ok()) return hint(bundle.status());
    roots = *std::move(bundle);
  }
  std::unique_ptr<TlsFiles> files(new TlsFiles(tls, *std::move(pair), std::move(roots)));
  files->reloader_ = std::thread([files = files.get()] {
    while (!files->stopping_.WaitForNotificationWithTimeout(files->initial_.reload_interval)) files->Reload();
  });
  return files;
}

TlsFiles::TlsFiles(const TlsOptions& tls, std::unique_ptr<tls::PublishedFile> pair,
                   std::unique_ptr<tls::CaBundle> roots)
    : initial_(tls),
      pair_(std::move(pair)),
      roots_(std::move(roots)),
      current_(tls),
      expiry_(tls::CertificateChainExpiry(tls.cert_chain).value_or(absl::UnixEpoch())) {  // validated
  if (roots_ != nullptr) current_.root_certs = roots_->current();
}

TlsFiles::~TlsFiles() {
  stopping_.Notify();
  if (reloader_.joinable()) reloader_.join();
}

TlsOptions TlsFiles::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

uint64_t TlsFiles::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

absl::Time TlsFiles::expiry() const {
  absl::MutexLock lock(&mu_);
  return expiry_;
}

bool TlsFiles::Reload() {
  const absl::StatusOr<TlsOptions> pair = ReadPair(initial_, current());
  const absl::StatusOr<bool> roots_changed = roots_ != nullptr ? roots_->Reload() : false;
  absl::MutexLock lock(&mu_);
  std::vector<std::string> refused;
  for (const absl::Status& status : {pair.status(), roots_changed.status()}) {
    if (!status.ok()) refused.emplace_back(status.message());
  }
  // Told once per reason, not every interval while the files stay as they are.
  if (std::string why = absl::StrJoin(refused, "; "); why != last_refused_) {
    if (!why.empty()) spdlog::warn("TLS files not taken (the last good ones stay in use): {}", why);
    last_refused_ = std::move(why);
  }
  bool changed = false;
  if (pair.ok() && (pair->cert_chain != current_.cert_chain || pair->private_key != current_.private_key)) {
    if (const absl::Status published = pair_->Publish(PairText(*pair)); published.ok()) {
      current_.cert_chain = pair->cert_chain;
      current_.private_key = pair->private_key;
      changed = true;
      expiry_ = tls::CertificateChainExpiry(pair->cert_chain).value_or(absl::UnixEpoch());  // validated
      spdlog::info("TLS: presenting the renewed certificate of {}, which expires {}", initial_.cert_file,
                   absl::FormatTime("%Y-%m-%d %H:%M UTC", expiry_, absl::UTCTimeZone()));
    } else {
      spdlog::warn("TLS: the renewed certificate could not be published: {}", std::string(published.message()));
    }
  }
  if (roots_changed.value_or(false)) {
    current_.root_certs = roots_->current();
    changed = true;
    spdlog::info("TLS: the peers' certificates are checked against the new CA bundle of {}", initial_.ca_file);
  }
  if (changed) ++generation_;
  return changed;
}

}  // namespace flatshard::server
