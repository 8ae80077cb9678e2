// Internal to the client: Completion collects the results of the requests one transfer
// is made of (one per server, or one per byte range) and completes the transfer's
// future once, when the last has finished: with the first error (AlreadyExists only if
// no request failed otherwise: a resent scatter that every server already held), else
// with the lowest version any request answered (absl::StatusOr<int64_t>) or OK
// (absl::Status).
// With `same_version` (the ranges of one split gather) requests that answered different
// versions end it with Aborted(kTornGather) instead: the caller gathers again. Thread-
// safe: requests finish from any thread; shared by them through a shared_ptr.
//
//   auto completion = std::make_shared<Completion<absl::Status>>(num_servers);
//   ... each request: completion->Finish(status, version);
//   return completion->future();
#ifndef FLATSHARD_CLIENT_COMPLETION_H_
#define FLATSHARD_CLIENT_COMPLETION_H_

#include <algorithm>
#include <cstdint>
#include <future>
#include <limits>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::client_internal {

// The message of a split gather's Aborted status when its ranges saw different versions.
inline constexpr absl::string_view kTornGather =
    "the ranges of a split gather saw different versions";

template <typename Result>
class Completion {
  static_assert(std::is_same_v<Result, absl::Status> ||
                std::is_same_v<Result, absl::StatusOr<int64_t>>);

 public:
  // `parts` >= 1 requests will call Finish.
  explicit Completion(int parts, bool same_version = false)
      : remaining_(parts), same_version_(same_version) {}

  // Call once, before the first Finish.
  std::future<Result> future() { return promise_.get_future(); }

  // One request's outcome; `version` counts only when `status` is OK.
  void Finish(const absl::Status& status, int64_t version) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && (status_.ok() || (absl::IsAlreadyExists(status_) && !absl::IsAlreadyExists(status)))) {
      status_ = status;
    }
    if (status.ok()) {
      min_version_ = std::min(min_version_, version);
      max_version_ = std::max(max_version_, version);
    }
    if (--remaining_ > 0) return;
    if (same_version_ && status_.ok() && min_version_ != max_version_) {
      status_ = absl::AbortedError(kTornGather);
    }
    if constexpr (std::is_same_v<Result, absl::Status>) {
      promise_.set_value(status_);
    } else {
      promise_.set_value(status_.ok() ? Result(min_version_) : Result(status_));
    }
  }

 private:
  absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_);
  const bool same_version_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int64_t min_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  int64_t max_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::min();
  std::promise<Result> promise_;
};

// A future that is ready with `result`.
template <typename Result>
std::future<Result> ReadyFuture(Result result) {
  std::promise<Result> promise;
  promise.set_value(std::move(result));
  return promise.get_future();
}

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_COMPLETION_H_
