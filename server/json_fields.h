// Numbers read from a checkpoint's JSON (manifest, parts): a count, a size, a version or a
// rank must be a non-negative integer that fits int64. nlohmann converts whatever is there
// (0.5 to 0, -1 to a huge unsigned, and 1e30 by a conversion C++ leaves undefined), so a
// damaged manifest could load a group at version -1 or with a wrong optimizer step count.
// Pure functions; thread-safe.
#ifndef FLATSHARD_SERVER_JSON_FIELDS_H_
#define FLATSHARD_SERVER_JSON_FIELDS_H_

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::server {

// `object[key]` as an integer in [0, 2^63): `absent` where the key is missing (or `object`
// is not an object); DataLoss "<what>: \"key\" must be a non-negative integer, not <it>"
// for anything else (a fraction, a negative number, a string, 2^63 or more).
[[nodiscard]] absl::StatusOr<int64_t> NonNegativeInteger(const nlohmann::json& object, absl::string_view key,
                                                         int64_t absent, const std::string& what);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_JSON_FIELDS_H_
