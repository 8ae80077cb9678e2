#include "server/json_fields.h"

#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace flatshard::server {

absl::StatusOr<int64_t> NonNegativeInteger(const nlohmann::json& object, absl::string_view key, int64_t absent,
                                           const std::string& what) {
  if (!object.is_object()) return absent;
  const auto found = object.find(std::string(key));
  if (found == object.end()) return absent;
  const nlohmann::json& value = *found;
  if (value.is_number_unsigned() && value.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}) {
    return static_cast<int64_t>(value.get<uint64_t>());
  }
  if (value.is_number_integer() && !value.is_number_unsigned() && value.get<int64_t>() >= 0) {
    return value.get<int64_t>();
  }
  return absl::DataLossError(
      absl::StrCat(what, ": \"", key, "\" must be a non-negative integer, not ", value.dump()));
}

}  // namespace flatshard::server
