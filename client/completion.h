// Internal to the client: Completion collects the results of the requests one transfer
// is made of (one per server, or one per byte range) and completes the transfer's
// future once, when the last has finished: with the first error (AlreadyExists only if
// no request failed otherwise: a resent scatter that every server already held), else
// with the lowest version any request answered (absl::StatusOr<int64_t>) or OK
// (absl::Status).
// A gather's (absl::StatusOr<int64_t>) requests must also answer from the state of one
// checkpoint load (transport/data_protocol.h): parts of different loads, read while a
// load was committing or from servers a load did not reach, end it with Aborted. With
// `same_version` (the ranges of one split gather) requests that answered different
// versions or loads end it with Aborted(kTornGather) instead: the caller gathers that
// part again. `on_ok` (optional) hears the lowest version and the load of a transfer
// that completes OK (a gather's after the checks above), before its future is ready.
// Thread-safe: requests finish from any thread; shared by them through a shared_ptr.
//
//   auto completion = std::make_shared<Completion<absl::Status>>(num_servers);
//   ... each request: completion->Finish(status, version);
//   return completion->future();
#ifndef FLATSHARD_CLIENT_COMPLETION_H_
#define FLATSHARD_CLIENT_COMPLETION_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::client_internal {

// The message of a split gather's Aborted status when its ranges saw different versions
// or loads.
inline constexpr absl::string_view kTornGather =
    "the ranges of a split gather saw different versions or checkpoint loads";

template <typename Result>
class Completion {
  static_assert(std::is_same_v<Result, absl::Status> ||
                std::is_same_v<Result, absl::StatusOr<int64_t>>);
  static constexpr bool kGather = std::is_same_v<Result, absl::StatusOr<int64_t>>;

 public:
  // `parts` >= 1 requests will call Finish.
  explicit Completion(int parts, bool same_version = false,
                      std::function<void(int64_t min_version, uint64_t load_id)> on_ok = nullptr)
      : remaining_(parts), same_version_(same_version), on_ok_(std::move(on_ok)) {}

  // Call once, before the first Finish.
  std::future<Result> future() { return promise_.get_future(); }

  // One request's outcome; `version` and `load_id` (the checkpoint load its state comes
  // from) count only when `status` is OK.
  void Finish(const absl::Status& status, int64_t version, uint64_t load_id = 0) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && (status_.ok() || (absl::IsAlreadyExists(status_) && !absl::IsAlreadyExists(status)))) {
      status_ = status;
    }
    if (status.ok()) {
      min_version_ = std::min(min_version_, version);
      max_version_ = std::max(max_version_, version);
      if (!load_id_.has_value()) {
        load_id_ = load_id;
      } else if (*load_id_ != load_id) {
        other_load_id_ = load_id;
      }
    }
    if (--remaining_ > 0) return;
    if constexpr (kGather) {
      const bool torn = min_version_ != max_version_ || other_load_id_.has_value();
      if (same_version_ && status_.ok() && torn) {
        status_ = absl::AbortedError(kTornGather);
      } else if (status_.ok() && other_load_id_.has_value()) {
        status_ = absl::AbortedError(absl::StrCat(
            "the servers answered this gather from the states of two checkpoint loads (", LoadName(*load_id_), " and ",
            LoadName(*other_load_id_),
            "): a load was being committed, or did not commit on every server (flatshard status shows each "
            "server's load); gather again"));
      }
    }
    if (status_.ok() && on_ok_) on_ok_(min_version_, load_id_.value_or(0));
    if constexpr (std::is_same_v<Result, absl::Status>) {
      promise_.set_value(status_);
    } else {
      promise_.set_value(status_.ok() ? Result(min_version_) : Result(status_));
    }
  }

  // Once the future is ready and OK: the load the parts' state came from.
  uint64_t load_id() const {
    absl::MutexLock lock(&mu_);
    return load_id_.value_or(0);
  }

 private:
  static std::string LoadName(uint64_t load_id) {
    return load_id == 0 ? std::string("none") : absl::StrCat("load ", absl::Hex(load_id));
  }

  mutable absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_);
  const bool same_version_;
  const std::function<void(int64_t, uint64_t)> on_ok_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int64_t min_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  int64_t max_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::min();
  std::optional<uint64_t> load_id_ ABSL_GUARDED_BY(mu_);        // the first OK part's
  std::optional<uint64_t> other_load_id_ ABSL_GUARDED_BY(mu_);  // a later part's, if another
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
