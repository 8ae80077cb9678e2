#include "tls/ca_bundle.h"

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

absl::StatusOr<std::unique_ptr<CaBundle>> CaBundle::Start(const std::string& file, const std::string& what) {
  FLATSHARD_ASSIGN_OR_RETURN(std::string pem, ReadCaBundle(file, what));
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<PublishedFile> published, PublishedFile::Create(pem));
  return std::unique_ptr<CaBundle>(new CaBundle(file, what, std::move(pem), std::move(published)));
}

CaBundle::CaBundle(std::string file, std::string what, std::string pem, std::unique_ptr<PublishedFile> published)
    : file_(std::move(file)), what_(std::move(what)), current_(std::move(pem)), published_(std::move(published)) {}

std::string CaBundle::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

absl::StatusOr<bool> CaBundle::Reload(const std::function<absl::Status(const std::string&)>& accept) {
  FLATSHARD_ASSIGN_OR_RETURN(std::string pem, ReadCaBundle(file_, what_));
  if (pem == current()) return false;
  if (accept) FLATSHARD_RETURN_IF_ERROR(accept(pem));  // not under mu_: it may read other files' state
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(published_->Publish(pem));
  current_ = std::move(pem);
  return true;
}

}  // namespace flatshard::tls
