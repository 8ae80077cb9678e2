// Authentication helpers: the control-plane token check and the data-plane session
// tokens that OpenSession issues. Thread-safe.
//
//   SessionTokens sessions;
//   std::string token = sessions.Issue();      // sent to the worker over gRPC
//   bool ok = sessions.Valid(token_from_hello); // checked on each data connection
#ifndef FLATSHARD_SERVER_AUTH_H_
#define FLATSHARD_SERVER_AUTH_H_

#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::server {

// Compares in time that depends only on the lengths, not on where the bytes differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

class SessionTokens {
 public:
  // A fresh 128-bit random token (hex), remembered until the server stops.
  std::string Issue();
  bool Valid(absl::string_view token) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_set<std::string> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_AUTH_H_
