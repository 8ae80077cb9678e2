#include "tls/reloader.h"

#include <utility>

namespace flatshard::tls {

Reloader::Reloader(absl::Duration interval, std::function<void()> reload)
    : thread_([this, interval, reload = std::move(reload)] {
        while (!stopping_.WaitForNotificationWithTimeout(interval)) reload();
      }) {}

Reloader::~Reloader() {
  stopping_.Notify();
  thread_.join();
}

}  // namespace flatshard::tls
