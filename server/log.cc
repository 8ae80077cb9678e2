#include "server/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <grpc/support/log.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/log_throttle.h"

namespace flatshard::server {
namespace {

// Whether gRPC's lines go to spdlog: from ConfigureLogging until the process exits (gRPC's
// globals may log while they are destroyed, after spdlog's registry is).
std::atomic<bool> grpc_to_spdlog{false};

// The throttles of gRPC's lines that come as warnings (its errors) and as debug lines, per
// place in gRPC's source ("ssl_transport_security.cc:123"); never destroyed: gRPC may log
// at exit.
LogThrottle& GrpcThrottle(spdlog::level::level_enum level) {
  static LogThrottle* const warnings = new LogThrottle;
  static LogThrottle* const debug = new LogThrottle;
  return level == spdlog::level::warn ? *warnings : *debug;
}

// gRPC's own lines (a failed TLS handshake on the control port, say: one per connection of
// a scanner) as the server's, throttled per place in gRPC's source.
void LogGrpcLine(gpr_log_func_args* args) {
  const absl::string_view file = args->file == nullptr ? "" : args->file;
  const absl::string_view base = file.substr(file.rfind('/') + 1);  // npos + 1 == 0: all of it
  const char* const message = args->message == nullptr ? "" : args->message;
  if (!grpc_to_spdlog.load()) {
    std::fprintf(stderr, "grpc: %s (%s:%d)\n", message, std::string(base).c_str(), args->line);
    return;
  }
  const spdlog::level::level_enum level =
      args->severity == GPR_LOG_SEVERITY_ERROR ? spdlog::level::warn : spdlog::level::debug;
  const std::optional<int64_t> held_back = GrpcThrottle(level).Admit(absl::StrCat(base, ":", args->line));
  if (!held_back.has_value()) return;
  spdlog::log(level, "grpc: {} ({}:{}){}", message, std::string(base), args->line,
              LogThrottle::HeldBack(*held_back));
}

}  // namespace

absl::Status ConfigureLogging(const LogOptions& options) {
  spdlog::level::level_enum level;
  if (options.level == "debug") {
    level = spdlog::level::debug;
  } else if (options.level == "info") {
    level = spdlog::level::info;
  } else if (options.level == "warning") {
    level = spdlog::level::warn;
  } else if (options.level == "error") {
    level = spdlog::level::err;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level=", options.level, ": expected debug, info, warning or error"));
  }
  std::shared_ptr<spdlog::logger> logger;
  try {
    logger = options.file.empty() ? spdlog::stderr_logger_mt("flatshard")
                                  : spdlog::basic_logger_mt("flatshard", options.file, /*truncate=*/false);
  } catch (const spdlog::spdlog_ex& error) {
    return absl::FailedPreconditionError(absl::StrCat("--log_file=", options.file, ": ", error.what()));
  }
  // The rank tells the servers of one node (or one log collector) apart.
  logger->set_pattern(absl::StrCat("%Y-%m-%d %H:%M:%S.%e rank ", options.rank, " %^%l%$: %v"));
  logger->set_level(level);
  logger->flush_on(spdlog::level::trace);  // every line at once: events are few, and a crash loses none
  spdlog::set_default_logger(std::move(logger));
  // The exit handler runs before spdlog's registry (made above) is destroyed.
  if (!grpc_to_spdlog.exchange(true)) std::atexit([] { grpc_to_spdlog.store(false); });
  gpr_set_log_function(&LogGrpcLine);
  return absl::OkStatus();
}

void LogHeldBackGrpcLines(absl::Time now) {
  for (const spdlog::level::level_enum level : {spdlog::level::warn, spdlog::level::debug}) {
    for (const auto& [place, count] : GrpcThrottle(level).TakeHeldBack(now)) {
      spdlog::log(level, "held back: {} more gRPC lines from {} after the last one logged", count, place);
    }
  }
}

bool WorthAWarning(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

}  // namespace flatshard::server
