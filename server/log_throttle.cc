#include "server/log_throttle.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace flatshard::server {

std::optional<int64_t> LogThrottle::Admit(absl::string_view kind, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Window& window = windows_[kind];
  if (now - window.start >= period_) {
    window.start = now;
    window.logged = 0;
  }
  if (window.logged >= burst_) {
    ++window.held_back;
    return std::nullopt;
  }
  ++window.logged;
  const int64_t held_back = window.held_back;
  window.held_back = 0;
  return held_back;
}

std::vector<std::pair<std::string, int64_t>> LogThrottle::TakeHeldBack(absl::Time now) {
  std::vector<std::pair<std::string, int64_t>> taken;
  absl::MutexLock lock(&mu_);
  for (auto& [kind, window] : windows_) {
    if (window.held_back == 0 || now - window.start < period_) continue;
    taken.emplace_back(kind, window.held_back);
    window.held_back = 0;
  }
  std::sort(taken.begin(), taken.end());
  return taken;
}

std::string LogThrottle::HeldBack(int64_t count) {
  if (count == 0) return "";
  return absl::StrCat(" (", count, " more like it held back since the last such line)");
}

}  // namespace flatshard::server
