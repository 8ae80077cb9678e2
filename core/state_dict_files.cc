#include "core/state_dict_files.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace flatshard {
namespace {

// Whether `text` is 5 or more decimal digits.
bool IsFileNumber(absl::string_view text) {
  return text.size() >= 5 &&
         std::all_of(text.begin(), text.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; });
}

}  // namespace

bool IsSplitStateDictFileName(absl::string_view name, absl::string_view prefix) {
  if (!absl::ConsumePrefix(&name, prefix) || !absl::ConsumePrefix(&name, "-") ||
      !absl::ConsumeSuffix(&name, ".safetensors")) {
    return false;
  }
  const size_t of = name.find("-of-");
  return of != absl::string_view::npos && IsFileNumber(name.substr(0, of)) && IsFileNumber(name.substr(of + 4));
}

bool IsStateDictFileName(absl::string_view name) {
  for (absl::string_view prefix : {"model", "optimizer"}) {
    absl::string_view rest = name;
    if (!absl::ConsumePrefix(&rest, prefix)) continue;
    if (rest == ".safetensors" || rest == ".safetensors.index.json" || IsSplitStateDictFileName(name, prefix)) {
      return true;
    }
  }
  return false;
}

bool IsShardFileName(absl::string_view name, int* index) {
  absl::string_view number = name;
  int value = 0;
  if (!absl::ConsumePrefix(&number, "shard-") || !absl::ConsumeSuffix(&number, ".safetensors") ||
      number.empty() || !std::isdigit(static_cast<unsigned char>(number[0])) || !absl::SimpleAtoi(number, &value) ||
      name != ShardFileName(value)) {  // one name per index: no sign, no leading zeros
    return false;
  }
  if (index != nullptr) *index = value;
  return true;
}

std::string ShardFileName(int index) { return absl::StrCat("shard-", index, ".safetensors"); }

absl::StatusOr<std::map<std::string, std::string>> ParseWeightMap(absl::string_view text, const std::string& where) {
  const nlohmann::json parsed = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object() || !parsed.contains("weight_map") || !parsed["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("'", where, "' is not JSON with a \"weight_map\" object"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, file] : parsed["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", where, "' maps tensor '", tensor, "' to ", file.dump(), ", not a file name"));
    }
    weight_map[tensor] = file.get<std::string>();
  }
  return weight_map;
}

}  // namespace flatshard
