#include "server/tls_files.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace flatshard::server {
namespace {

// `file`'s bundle kept current, or null without a file.
absl::StatusOr<std::unique_ptr<tls::CaBundle>> OptionalBundle(const std::string& file, const std::string& flag) {
  if (file.empty()) return nullptr;
  return tls::CaBundle::Start(file, flag);
}

std::string When(absl::Time time) { return absl::FormatTime("%Y-%m-%d %H:%M UTC", time, absl::UTCTimeZone()); }

}  // namespace

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Start(const TlsOptions& tls) {
  auto hint = [](const absl::Status& status) {  // no /proc: say how to do without
    if (!absl::IsFailedPrecondition(status)) return status;
    return absl::FailedPreconditionError(
        absl::StrCat("--tls_reload_interval: ", status.message(), "; 0 turns reloads off"));
  };
  absl::StatusOr<std::unique_ptr<tls::KeyPair>> pair =
      tls::KeyPair::Start(tls.cert_file, "--tls_cert_file", tls.key_file, "--tls_key_file");
  if (!pair.ok()) return hint(pair.status());
  absl::StatusOr<std::unique_ptr<tls::CaBundle>> roots = OptionalBundle(tls.ca_file, "--tls_ca_file");
  if (!roots.ok()) return hint(roots.status());
  absl::StatusOr<std::unique_ptr<tls::CaBundle>> client_roots =
      OptionalBundle(tls.client_ca_file, "--tls_client_ca_file");
  if (!client_roots.ok()) return hint(client_roots.status());
  std::unique_ptr<TlsFiles> files(
      new TlsFiles(tls, *std::move(pair), *std::move(roots), *std::move(client_roots)));
  // The files may have changed since `tls` was read from them: check what is in use.
  FLATSHARD_RETURN_IF_ERROR(ValidateTls(files->current()));
  files->reloader_ = std::make_unique<tls::Reloader>(tls.reload_interval, [files = files.get()] { files->Reload(); });
  return files;
}

TlsFiles::TlsFiles(const TlsOptions& tls, std::unique_ptr<tls::KeyPair> pair, std::unique_ptr<tls::CaBundle> roots,
                   std::unique_ptr<tls::CaBundle> client_roots)
    : initial_(tls),
      pair_(std::move(pair)),
      roots_(std::move(roots)),
      client_roots_(std::move(client_roots)) {}

TlsFiles::~TlsFiles() { reloader_.reset(); }

TlsOptions TlsFiles::current() const {
  TlsOptions options = initial_;
  const tls::KeyPair::Pem pem = pair_->current();
  options.cert_chain = pem.cert_chain;
  options.private_key = pem.private_key;
  if (roots_ != nullptr) options.root_certs = roots_->current();
  if (client_roots_ != nullptr) options.client_root_certs = client_roots_->current();
  return options;
}

uint64_t TlsFiles::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

absl::Time TlsFiles::expiry() const { return pair_->current().expiry; }

bool TlsFiles::Reload() {
  absl::MutexLock reloading(&reload_mu_);
  // With client CAs, the pair and the client bundle must go together (CheckPeersAccept).
  auto verifies = [this](const std::string& cert_chain, const std::string& client_root_certs) {
    if (client_roots_ == nullptr) return absl::OkStatus();
    TlsOptions options = initial_;
    options.cert_chain = cert_chain;
    options.client_root_certs = client_root_certs;
    return CheckPeersAccept(options);
  };
  const absl::StatusOr<bool> client_roots_changed =
      client_roots_ != nullptr ? client_roots_->Reload([&](const std::string& bundle) {
        return verifies(pair_->current().cert_chain, bundle);
      })
                               : false;
  const absl::StatusOr<bool> pair_changed = pair_->Reload([&](const tls::KeyPair::Pem& pem) {
    return verifies(pem.cert_chain, client_roots_ != nullptr ? client_roots_->current() : "");
  });
  const absl::StatusOr<bool> roots_changed = roots_ != nullptr ? roots_->Reload() : false;

  absl::MutexLock lock(&mu_);
  std::vector<std::string> refused;
  for (const absl::Status& status : {pair_changed.status(), roots_changed.status(), client_roots_changed.status()}) {
    if (!status.ok()) refused.emplace_back(status.message());
  }
  // Told once per reason, not every interval while the files stay as they are.
  if (std::string why = absl::StrJoin(refused, "; "); why != last_refused_) {
    if (!why.empty()) spdlog::warn("TLS files not taken (the last good ones stay in use): {}", why);
    last_refused_ = std::move(why);
  }
  bool changed = false;
  if (pair_changed.value_or(false)) {
    spdlog::info("TLS: presenting the renewed certificate of {}, which expires {}", initial_.cert_file,
                 When(pair_->current().expiry));
    changed = true;
  }
  if (roots_changed.value_or(false)) {
    spdlog::info("TLS: the peers' certificates are checked against the new CA bundle of {}", initial_.ca_file);
    changed = true;
  }
  if (client_roots_changed.value_or(false)) {
    spdlog::info("TLS: callers' certificates are checked against the new CA bundle of {}", initial_.client_ca_file);
    changed = true;
  }
  if (changed) ++generation_;
  return changed;
}

}  // namespace flatshard::server
