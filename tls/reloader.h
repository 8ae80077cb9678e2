// Reloader: calls a function every `interval` on a thread of its own, from one interval
// after construction until it is destroyed (the destructor waits for a call in
// progress). For files read again on a timer (tls/ca_bundle.h, tls/key_pair.h).
//
//   Reloader reloader(absl::Minutes(5), [&] { (void)bundle->Reload(); });
#ifndef FLATSHARD_TLS_RELOADER_H_
#define FLATSHARD_TLS_RELOADER_H_

#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace flatshard::tls {

class Reloader {
 public:
  // Precondition: interval > 0.
  Reloader(absl::Duration interval, std::function<void()> reload);
  ~Reloader();
  Reloader(const Reloader&) = delete;
  Reloader& operator=(const Reloader&) = delete;

 private:
  absl::Notification stopping_;
  std::thread thread_;  // last: starts once the rest is made
};

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_RELOADER_H_
