#include "tls/key_pair.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "tls/certificates.h"

namespace flatshard::tls {
namespace {

// The key then the chain, as gRPC's watcher reads both from one file.
std::string WatchedText(const KeyPair::Pem& pem) { return pem.private_key + "\n" + pem.cert_chain; }

}  // namespace

absl::StatusOr<KeyPair::Pem> KeyPair::Read(const std::string& cert_file, const std::string& cert_what,
                                           const std::string& key_file, const std::string& key_what) {
  KeyPair::Pem pem;
  for (const auto& [file, what, text] :
       {std::tuple{&cert_file, &cert_what, &pem.cert_chain}, std::tuple{&key_file, &key_what, &pem.private_key}}) {
    absl::StatusOr<std::string> read = ReadFileToString(*file);
    if (!read.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot read ", *what, "=", *file, ": ", read.status().message()));
    }
    *text = *std::move(read);
  }
  FLATSHARD_ASSIGN_OR_RETURN(pem.expiry, CheckIdentity(pem.cert_chain, absl::StrCat(cert_what, "=", cert_file),
                                                       pem.private_key, absl::StrCat(key_what, "=", key_file)));
  return pem;
}

absl::StatusOr<std::unique_ptr<KeyPair>> KeyPair::Start(const std::string& cert_file, const std::string& cert_what,
                                                        const std::string& key_file, const std::string& key_what) {
  FLATSHARD_ASSIGN_OR_RETURN(Pem pem, Read(cert_file, cert_what, key_file, key_what));
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<PublishedFile> published, PublishedFile::Create(WatchedText(pem)));
  return std::unique_ptr<KeyPair>(
      new KeyPair(cert_file, cert_what, key_file, key_what, std::move(pem), std::move(published)));
}

KeyPair::KeyPair(std::string cert_file, std::string cert_what, std::string key_file, std::string key_what, Pem pem,
                 std::unique_ptr<PublishedFile> published)
    : cert_file_(std::move(cert_file)),
      cert_what_(std::move(cert_what)),
      key_file_(std::move(key_file)),
      key_what_(std::move(key_what)),
      current_(std::move(pem)),
      published_(std::move(published)) {}

KeyPair::Pem KeyPair::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

absl::StatusOr<bool> KeyPair::Reload(const std::function<absl::Status(const Pem&)>& accept) {
  FLATSHARD_ASSIGN_OR_RETURN(Pem pem, Read(cert_file_, cert_what_, key_file_, key_what_));
  if (const Pem in_use = current(); pem.cert_chain == in_use.cert_chain && pem.private_key == in_use.private_key) {
    return false;
  }
  if (accept) FLATSHARD_RETURN_IF_ERROR(accept(pem));  // not under mu_: it may read other files' state
  absl::MutexLock lock(&mu_);
  FLATSHARD_RETURN_IF_ERROR(published_->Publish(WatchedText(pem)));
  current_ = std::move(pem);
  return true;
}

}  // namespace flatshard::tls
