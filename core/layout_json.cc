#include "core/layout_json.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard {
namespace {

using Json = nlohmann::json;

// Reads an integer field; `path` names it in errors.
absl::StatusOr<int64_t> GetInteger(const Json& object, const char* key, absl::string_view path,
                                   std::optional<int64_t> default_value = std::nullopt) {
  const auto it = object.find(key);
  if (it == object.end()) {
    if (default_value) return *default_value;
    return absl::InvalidArgumentError(absl::StrCat(path, key, ": missing"));
  }
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, key, ": must be an integer, got ", it->dump()));
  }
  return it->get<int64_t>();
}

absl::StatusOr<TensorSpec> ParseTensor(const Json& entry, size_t index) {
  const std::string path = absl::StrCat("tensors[", index, "].");
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("tensors[", index, "]: must be an object"));
  }
  TensorSpec spec;
  const auto name = entry.find("name");
  if (name == entry.end() || !name->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(path, "name: missing or not a string"));
  }
  spec.fqn = name->get<std::string>();
  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, "shape: missing or not an array"));
  }
  for (size_t dim = 0; dim < shape->size(); ++dim) {
    if (!(*shape)[dim].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(path, "shape[", dim,
                                                     "]: must be an integer, got ",
                                                     (*shape)[dim].dump()));
    }
    spec.shape.push_back((*shape)[dim].get<int64_t>());
  }
  const auto dtype = entry.find("dtype");
  if (dtype != entry.end()) {
    if (!dtype->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, "dtype: must be a string"));
    }
    absl::StatusOr<DType> parsed = ParseDType(dtype->get<std::string>());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, "dtype: ", parsed.status().message()));
    }
    spec.dtype = *parsed;
  }
  return spec;
}

}  // namespace

absl::StatusOr<FlatLayout> ParseLayoutSpecJson(absl::string_view text) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception& error) {  // parse_error, or out_of_range for a number like 1e999
    return absl::InvalidArgumentError(absl::StrCat("malformed JSON: ", error.what()));
  }
  if (!root.is_object()) return absl::InvalidArgumentError("spec: must be a JSON object");
  FLATSHARD_ASSIGN_OR_RETURN(const int64_t servers, GetInteger(root, "servers", ""));
  if (servers < 1 || servers > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("servers: ", servers, ", must be in [1, 1048576]"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(const int64_t align, GetInteger(root, "align", "", 0));
  const auto tensors = root.find("tensors");
  if (tensors == root.end() || !tensors->is_array()) {
    return absl::InvalidArgumentError("tensors: missing or not an array");
  }
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < tensors->size(); ++i) {
    FLATSHARD_ASSIGN_OR_RETURN(TensorSpec spec, ParseTensor((*tensors)[i], i));
    specs.push_back(std::move(spec));
  }
  return FlatLayout::Create(std::move(specs), align, static_cast<int>(servers));
}

std::string LayoutToJson(const FlatLayout& layout) {
  Json root;
  root["unpadded_numel"] = layout.unpadded_numel();
  root["shard_numel"] = layout.shard_numel();
  root["padded_numel"] = layout.padded_numel();
  root["align"] = layout.align();
  root["servers"] = layout.num_shards();
  Json tensors = Json::array();
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const TensorSpec& spec = layout.tensor(i);
    tensors.push_back({{"name", spec.fqn},
                       {"shape", spec.shape},
                       {"dtype", DTypeName(spec.dtype)},
                       {"offset", layout.tensor_offset(i)},
                       {"numel", layout.tensor_numel(i)}});
  }
  root["tensors"] = std::move(tensors);
  Json shards = Json::array();
  for (int rank = 0; rank < layout.num_shards(); ++rank) {
    Json params = Json::array();
    for (int i = 0; i < layout.num_tensors(); ++i) {
      const ShardParamInfo info = layout.shard_param_info(rank, i);
      Json param = {{"name", layout.tensor(i).fqn}, {"in_shard", info.in_shard}};
      if (info.in_shard) {
        param["offset_in_shard"] = info.offset_in_shard;
        param["numel_in_shard"] = info.numel_in_shard;
        param["intra_param_start_idx"] = info.intra_param_start_idx;
        param["intra_param_end_idx"] = info.intra_param_end_idx;
      }
      params.push_back(std::move(param));
    }
    shards.push_back({{"rank", rank},
                      {"start", layout.shard_start(rank)},
                      {"end", layout.shard_end(rank)},
                      {"padding", layout.shard_padding(rank)},
                      {"params", std::move(params)}});
  }
  root["shards"] = std::move(shards);
  return root.dump(2) + "\n";
}

}  // namespace flatshard
