#include "server/auth.h"

#include <random>

#include "absl/strings/str_format.h"

namespace flatshard::server {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string SessionTokens::Issue() {
  std::random_device entropy;  // /dev/urandom on Linux
  std::string token;
  for (int i = 0; i < 4; ++i) absl::StrAppendFormat(&token, "%08x", entropy());
  absl::MutexLock lock(&mu_);
  tokens_.insert(token);
  issue_order_.push_back(token);
  if (issue_order_.size() > capacity_) {
    tokens_.erase(issue_order_.front());
    issue_order_.pop_front();
  }
  return token;
}

bool SessionTokens::Valid(absl::string_view token) const {
  absl::MutexLock lock(&mu_);
  return tokens_.contains(token);
}

}  // namespace flatshard::server
