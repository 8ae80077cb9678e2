// Server logging through spdlog's default logger: one line per event, to stderr (which
// systemd's journal and Kubernetes collect) or to --log_file, e.g.
//   2026-11-24 08:42:49.123 rank 0 info: job 'mlp' configured: 8 workers, sync, ...
// Levels: error (the server cannot do what it should: a cluster mismatch, an async save
// that failed), warning (a request refused for a reason an operator should see, memory
// dropped on a timeout), info (jobs, groups and checkpoints coming and going; start and
// stop), debug (every RPC with its outcome and time, every data-plane error).
// gRPC's own lines (GRPC_VERBOSITY: errors by default, such as a failed TLS handshake on
// the control port) come to the same log once ConfigureLogging ran, as warnings (errors)
// or debug lines, at most LogThrottle's burst from one place in gRPC per period; what a
// place held back is said by its next line let through or by LogHeldBackGrpcLines.
// The daemon calls ConfigureLogging once at start-up, before any thread logs; the
// server library then logs through spdlog (spdlog::info(...)), which is thread-safe.
// Without ConfigureLogging (unit tests) spdlog's own default logger prints at info.
//
//   FLATSHARD_RETURN_IF_ERROR(ConfigureLogging({.rank = 0, .level = "debug"}));
//   spdlog::info("job '{}' deleted", job);
#ifndef FLATSHARD_SERVER_LOG_H_
#define FLATSHARD_SERVER_LOG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace flatshard::server {

struct LogOptions {
  int rank = 0;                // in every line
  std::string level = "info";  // debug, info, warning or error
  std::string file;            // appended to (missing directories are made); empty: stderr
};

// InvalidArgument naming --log_level for an unknown level; FailedPrecondition naming
// --log_file when it cannot be opened for appending.
[[nodiscard]] absl::Status ConfigureLogging(const LogOptions& options);

// Logs, for each place in gRPC's source whose lines were held back in a period that ended
// by `now` (absl::InfiniteFuture(): whatever was held back), how many, at the level those
// lines had; the counts start again from 0. The server calls it with its own throttle's
// summary (every period and when it stops). Thread-safe.
void LogHeldBackGrpcLines(absl::Time now);

// Whether a request refused with `code` is logged at warning rather than debug: the
// refusals an operator should see whatever the level (malformed or unauthenticated
// requests, memory exhausted, damaged checkpoints, internal errors), not the outcomes of
// a working cluster (a deadline a wait ran into, a contribution sent again, a group not
// registered yet).
bool WorthAWarning(absl::StatusCode code);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_LOG_H_
