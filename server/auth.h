// Authentication helpers: the control-plane token check and the data-plane session
// tokens that OpenSession issues. Thread-safe.
//
// A server remembers the most recent `capacity` session tokens (every Client::Connect
// and every renewal issues one, for the life of the daemon): older ones stop opening
// new data connections, and a client whose hello is refused opens a new session
// (client/data_channel.h). Connections already open are not affected.
//
//   SessionTokens sessions;
//   std::string token = sessions.Issue();      // sent to the worker over gRPC
//   bool ok = sessions.Valid(token_from_hello); // checked on each data connection
#ifndef FLATSHARD_SERVER_AUTH_H_
#define FLATSHARD_SERVER_AUTH_H_

#include <algorithm>
#include <deque>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::server {

// Compares in time that depends only on the lengths, not on where the bytes differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

class SessionTokens {
 public:
  static constexpr size_t kDefaultCapacity = 4096;

  explicit SessionTokens(size_t capacity = kDefaultCapacity) : capacity_(std::max<size_t>(1, capacity)) {}

  // A fresh 128-bit random token (hex); the oldest one is forgotten beyond capacity.
  std::string Issue();
  bool Valid(absl::string_view token) const;

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_set<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> issue_order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_AUTH_H_
