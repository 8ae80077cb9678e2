// LogThrottle: keeps a flood of like warnings (a fleet of workers retrying with a wrong
// token, a scanner on the data port) from flooding the log, its disk and the server's
// time (every line is written at once). Each kind of line, as the caller names it ("rpc
// /flatshard.v1.Flatshard/GetStatus UNAUTHENTICATED"), gets at most `burst` lines per
// `period`; the lines past that are held back and counted, and the next line of that kind
// let through says how many were. Lines held back with none of their kind after them
// (the flood stopped) are said by TakeHeldBack's caller once their period has ended
// (Server, every period and at shutdown). The error counters (ServerStats::errors,
// rpc_errors) still count every refusal.
// Kinds come from small fixed sets (methods x codes, data ops x codes): one entry is kept
// per kind for the life of the server. Thread-safe.
//
//   if (const std::optional<int64_t> held_back = throttle.Admit(kind)) {
//     spdlog::warn("...{}", LogThrottle::HeldBack(*held_back));
//   }
#ifndef FLATSHARD_SERVER_LOG_THROTTLE_H_
#define FLATSHARD_SERVER_LOG_THROTTLE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatshard::server {

class LogThrottle {
 public:
  static constexpr int kBurst = 10;
  static constexpr absl::Duration kPeriod = absl::Seconds(10);

  explicit LogThrottle(int burst = kBurst, absl::Duration period = kPeriod) : burst_(burst), period_(period) {}

  // Whether a line of `kind` may be logged `now`: nullopt holds it back (counted);
  // otherwise how many lines of its kind were held back since the last one logged.
  [[nodiscard]] std::optional<int64_t> Admit(absl::string_view kind, absl::Time now = absl::Now());

  // What a line let through adds about the lines held back before it: "" for none, else
  // " (N more like it held back since the last such line)".
  static std::string HeldBack(int64_t count);

  // The kinds whose period ended by `now` with lines held back, and how many, sorted by
  // kind; those counts start again from 0 (the next line let through says none). With
  // absl::InfiniteFuture(), every kind with lines held back.
  std::vector<std::pair<std::string, int64_t>> TakeHeldBack(absl::Time now);

 private:
  struct Window {
    absl::Time start = absl::InfinitePast();
    int logged = 0;         // lines let through since `start`
    int64_t held_back = 0;  // since the last line let through
  };

  const int burst_;
  const absl::Duration period_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Window> windows_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_LOG_THROTTLE_H_
