#include "tls/ca_bundle.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "tls/certificates.h"

namespace flatshard::tls {

absl::StatusOr<std::string> ReadCaBundle(const std::string& file, const std::string& what) {
  absl::StatusOr<std::string> pem = ReadFileToString(file);
  if (!pem.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, "=", file, ": ", pem.status().message()));
  }
  FLATSHARD_RETURN_IF_ERROR(CheckCertificates(*pem, absl::StrCat(what, "=", file)));
  return pem;
}

absl::StatusOr<std::unique_ptr<CaBundle>> CaBundle::Start(const std::string& file, const std::string& what,
                                                          absl::Duration interval, bool reload_itself) {
  FLATSHARD_ASSIGN_OR_RETURN(std::string pem, ReadCaBundle(file, what));
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<PublishedFile> published, PublishedFile::Create(pem));
  std::unique_ptr<CaBundle> bundle(new CaBundle(file, what, interval, std::move(pem), std::move(published)));
  if (reload_itself) {
    bundle->reloader_ = std::thread([bundle = bundle.get()] {
      while (!bundle->stopping_.WaitForNotificationWithTimeout(bundle->interval_)) (void)bundle->Reload();
    });
  }
  return bundle;
}

CaBundle::CaBundle(std::string file, std::string what, absl::Duration interval, std::string pem,
                   std::unique_ptr<PublishedFile> published)
    : file_(std::move(file)),
      what_(std::move(what)),
      interval_(interval),
      current_(std::move(pem)),
      published_(std::move(published)) {}

CaBundle::~CaBundle() {
  stopping_.Notify();
  if (reloader_.joinable()) reloader_.join();
}

std::string CaBundle::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

absl::StatusOr<bool> CaBundle::Reload() {
  FLATSHARD_ASSIGN_OR_RETURN(std::string pem, ReadCaBundle(file_, what_));
  absl::MutexLock lock(&mu_);
  if (pem == current_) return false;
  FLATSHARD_RETURN_IF_ERROR(published_->Publish(pem));
  current_ = std::move(pem);
  return true;
}

std::shared_ptr<grpc::ChannelCredentials> CaBundle::Credentials() const {
  auto watcher = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      published_->path(), static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(interval_))));
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(watcher);
  options.watch_root_certs();
  options.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace flatshard::tls
