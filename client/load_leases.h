// LoadLeases: keeps a checkpoint load's staging alive on the servers that have prepared
// it while others still prepare (LoadCheckpoint RENEW). A server holds a staged load for
// its --staged_load_timeout from its staging or last renewal, and preparations take as
// long as each server's part of the checkpoint: without renewals, a server that prepared
// long before the slowest would drop its staging before the commit. Each prepared server
// is renewed once half the time it last said it holds the load has passed. Internal to
// the client library.
//
// Thread-safe: Prepared may be called from any thread; renewals run on a thread of this
// object, one at a time, until Stop (or destruction).
//
//   LoadLeases leases([&](size_t server) { return RenewOn(server); });
//   ... each preparing thread, once its server staged the load:
//   leases.Prepared(server, absl::Seconds(response.staged_for_seconds()));
//   FLATSHARD_RETURN_IF_ERROR(leases.Stop());  // then commit
#ifndef FLATSHARD_CLIENT_LOAD_LEASES_H_
#define FLATSHARD_CLIENT_LOAD_LEASES_H_

#include <cstddef>
#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::client_internal {

class LoadLeases {
 public:
  // `renew(server)` renews the load on `server` and returns how long it now holds it, or
  // why it does not (the load dropped, the server unreachable).
  explicit LoadLeases(std::function<absl::StatusOr<absl::Duration>(size_t server)> renew);
  ~LoadLeases();  // Stop()
  LoadLeases(const LoadLeases&) = delete;
  LoadLeases& operator=(const LoadLeases&) = delete;

  // `server` staged the load and holds it for `held_for` from now (not positive: it is
  // not renewed).
  void Prepared(size_t server, absl::Duration held_for);
  // Stops renewing (a renewal under way finishes first). The first renewal that failed;
  // OK when none did. Idempotent.
  absl::Status Stop();

 private:
  void RenewLoop();

  const std::function<absl::StatusOr<absl::Duration>(size_t)> renew_;
  absl::Mutex mu_;
  std::map<size_t, absl::Time> due_ ABSL_GUARDED_BY(mu_);  // by server: its next renewal
  bool changed_ ABSL_GUARDED_BY(mu_) = false;              // wakes the loop for a new server
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_LOAD_LEASES_H_
