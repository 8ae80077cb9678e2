// "1.5 MiB"-style byte counts for the CLI's tables. Pure; thread-safe.
#ifndef FLATSHARD_CLIENT_CLI_HUMAN_BYTES_H_
#define FLATSHARD_CLIENT_CLI_HUMAN_BYTES_H_

#include <cstdint>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flatshard::cli {

inline std::string HumanBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_HUMAN_BYTES_H_
