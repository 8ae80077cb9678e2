#include "server/checkpoint_import.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "core/state_dict_files.h"
#include "core/status_macros.h"

namespace flatshard::server {
namespace {

using Json = nlohmann::json;

// The optimizer states a FULL file may hold per tensor, in the order groups keep them
// (Optimizer::state_names).
constexpr const char* kStates[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};

// The tensors of one prefix's files ("model" or "optimizer"): one file, or the files a
// split state dict's index maps.
struct PrefixTensors {
  std::map<std::string, SafetensorsHeader> headers;  // by file; none: no such files
  std::vector<const SafetensorsTensor*> order;       // file by file, in each file's order
  absl::flat_hash_map<std::string, const SafetensorsTensor*> by_name;
  std::map<std::string, std::string> metadata;  // every file's, which must agree
};

// The index's weight_map (tensor -> file), each file one of `files`' split files.
absl::StatusOr<std::map<std::string, std::string>> ReadWeightMap(const std::string& dir, const std::string& index,
                                                                 const std::set<std::string>& split) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(dir + "/" + index));
  using WeightMap = std::map<std::string, std::string>;
  FLATSHARD_ASSIGN_OR_RETURN(WeightMap weight_map, ParseWeightMap(text, index));
  for (const auto& [tensor, file] : weight_map) {
    if (split.count(file) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", index, "' maps tensor '", tensor, "' to '", file, "', which is not among the files imported"));
    }
  }
  return weight_map;
}

absl::StatusOr<PrefixTensors> ReadPrefix(const std::string& dir, const std::map<std::string, uint64_t>& files,
                                         const std::string& prefix) {
  const std::string single = prefix + ".safetensors";
  const std::string index = single + ".index.json";
  std::set<std::string> split;
  for (const auto& [file, size] : files) {
    if (IsSplitStateDictFileName(file, prefix)) split.insert(file);
  }
  std::map<std::string, std::string> weight_map;  // tensor -> file, for split files
  std::vector<std::string> data_files;
  if (files.count(index) != 0) {
    if (files.count(single) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the import holds both '", single, "' and '", index, "': one of them only"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(weight_map, ReadWeightMap(dir, index, split));
    std::set<std::string> mapped;
    for (const auto& [tensor, file] : weight_map) mapped.insert(file);
    for (const std::string& file : split) {
      if (mapped.count(file) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("'", index, "' maps no tensor to '", file, "'"));
      }
    }
    data_files.assign(split.begin(), split.end());
  } else if (!split.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", *split.begin(), "' comes without '", index, "'"));
  } else if (files.count(single) != 0) {
    data_files.push_back(single);
  }
  PrefixTensors out;
  for (const std::string& file : data_files) {
    absl::StatusOr<SafetensorsHeader> header = SafetensorsHeader::Read(dir + "/" + file);
    if (!header.ok()) return absl::InvalidArgumentError(header.status().message());
    if (header->file_size() != files.at(file)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", file, "' has ", files.at(file), " bytes; its header describes ", header->file_size()));
    }
    for (const auto& [key, value] : header->metadata()) {
      const auto [it, added] = out.metadata.emplace(key, value);
      if (!added && it->second != value) {
        return absl::InvalidArgumentError(absl::StrCat("the ", prefix, " files disagree on metadata '", key, "': '",
                                                       it->second, "' and '", value, "'"));
      }
    }
    const SafetensorsHeader& kept = out.headers.emplace(file, *std::move(header)).first->second;
    for (const SafetensorsTensor& tensor : kept.tensors()) {
      if (!weight_map.empty()) {
        auto mapped = weight_map.find(tensor.name);
        if (mapped == weight_map.end() || mapped->second != file) {
          return absl::InvalidArgumentError(absl::StrCat(
              "'", file, "' holds tensor '", tensor.name, "', which '", index, "' maps ",
              mapped == weight_map.end() ? std::string("to no file") : absl::StrCat("to '", mapped->second, "'")));
        }
      }
      if (!out.by_name.emplace(tensor.name, &tensor).second) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor.name, "' is in two ", prefix, " files"));
      }
      out.order.push_back(&tensor);
    }
  }
  for (const auto& [tensor, file] : weight_map) {
    if (out.by_name.count(tensor) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", index, "' maps tensor '", tensor, "' to '", file, "', which does not hold it"));
    }
  }
  return out;
}

Json TensorJson(const SafetensorsTensor& tensor) {
  return {{"name", tensor.name}, {"shape", tensor.shape}, {"dtype", DTypeName(tensor.dtype)}};
}

// `group`'s field `suffix` of the optimizer metadata, or null.
const std::string* Field(const std::map<std::string, std::string>& metadata, const std::string& group,
                         absl::string_view suffix) {
  auto it = metadata.find(absl::StrCat(group, suffix));
  return it == metadata.end() ? nullptr : &it->second;
}

absl::StatusOr<int64_t> NonNegativeField(const std::map<std::string, std::string>& metadata, const std::string& group,
                                         absl::string_view suffix, std::optional<int64_t> absent) {
  const std::string* text = Field(metadata, group, suffix);
  if (text == nullptr && absent.has_value()) return *absent;
  int64_t value = 0;
  if (text == nullptr || !absl::SimpleAtoi(*text, &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("the optimizer metadata's '", group, suffix, "' is ",
                                                   text == nullptr ? "missing" : "'" + *text + "'",
                                                   "; it must be an integer >= 0"));
  }
  return value;
}

// The groups the optimizer metadata describes, each with its tensors' state.
absl::StatusOr<Json> OptimizerGroups(const PrefixTensors& model, const PrefixTensors& state, int64_t version) {
  Json groups = Json::array();
  absl::flat_hash_map<std::string, std::string> owner;  // model tensor -> its group
  std::set<std::string> claimed;                        // the state tensors of the groups' tensors
  for (const auto& [key, value] : state.metadata) {
    absl::string_view group_view = key;
    if (!absl::ConsumeSuffix(&group_view, ".params")) continue;
    const std::string group(group_view);
    const std::string* optimizer = Field(state.metadata, group, ".optimizer");
    if (optimizer == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the optimizer metadata lacks '", group, ".optimizer'"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t steps, NonNegativeField(state.metadata, group, ".step", std::nullopt));
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t group_version,
                               NonNegativeField(state.metadata, group, ".version", version));
    const std::vector<std::string> fqns = absl::StrSplit(value, ',');
    // The state the group's first tensor has is the group's.
    std::vector<std::string> states;
    for (const char* name : kStates) {
      if (state.by_name.count(absl::StrCat(fqns.front(), ".", name)) != 0) states.push_back(name);
    }
    Json tensors = Json::array();
    for (const std::string& fqn : fqns) {
      auto found = model.by_name.find(fqn);
      if (found == model.by_name.end()) {
        return absl::InvalidArgumentError(absl::StrCat("group '", group, "' of the optimizer metadata lists tensor '",
                                                       fqn, "', which the model files do not hold"));
      }
      const SafetensorsTensor& tensor = *found->second;
      if (const auto [it, added] = owner.emplace(fqn, group); !added) {
        return absl::InvalidArgumentError(absl::StrCat("the optimizer metadata lists tensor '", fqn, "' in groups '",
                                                       it->second, "' and '", group, "'"));
      }
      for (const char* name : kStates) {
        const std::string state_name = absl::StrCat(fqn, ".", name);
        auto held = state.by_name.find(state_name);
        const bool wanted = std::find(states.begin(), states.end(), name) != states.end();
        if (held == state.by_name.end() && !wanted) continue;
        if (held == state.by_name.end() || !wanted) {
          return absl::InvalidArgumentError(absl::StrCat(
              "group '", group, "' has optimizer state [", absl::StrJoin(states, ", "), "] for tensor '", fqns.front(),
              "' but ", held == state.by_name.end() ? "lacks " : "also holds ", "'", state_name, "'"));
        }
        if (held->second->dtype != DType::kFloat32 || held->second->shape != tensor.shape) {
          return absl::InvalidArgumentError(absl::StrCat(
              "optimizer state '", state_name, "' must be float32 of the tensor's shape ", Json(tensor.shape).dump()));
        }
        claimed.insert(state_name);
      }
      tensors.push_back(TensorJson(tensor));
    }
    const std::string* momentum = Field(state.metadata, group, ".momentum_initialized");
    const bool has_momentum = std::find(states.begin(), states.end(), "momentum_buffer") != states.end();
    groups.push_back({{"name", group},
                      {"tensors", std::move(tensors)},
                      {"version", group_version},
                      {"optimizer", *optimizer},
                      {"optimizer_steps", steps},
                      {"momentum_initialized", momentum != nullptr ? *momentum == "true" : has_momentum && steps > 0},
                      {"state", states}});
  }
  if (groups.empty()) {
    return absl::InvalidArgumentError(
        "the optimizer files' metadata describes no group (\"<group>.params\": its tensors' names)");
  }
  for (const SafetensorsTensor* tensor : model.order) {
    if (owner.count(tensor->name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model tensor '", tensor->name, "' is in no group of the optimizer metadata (\"<group>.params\")"));
    }
  }
  for (const SafetensorsTensor* tensor : state.order) {
    if (claimed.count(tensor->name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer tensor '", tensor->name, "' is the state of no tensor of the groups"));
    }
  }
  return groups;
}

}  // namespace

absl::Status CheckImportedFileName(const std::string& file) {
  if (IsStateDictFileName(file)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("'", file, "' is not a file of a FULL state dict (model.safetensors, model-<i>-of-<n>.safetensors, ",
                   "model.safetensors.index.json, and the same for optimizer)"));
}

absl::StatusOr<ImportedCheckpoint> DescribeImport(const std::string& dir, const std::map<std::string, uint64_t>& files,
                                                  int64_t version, Json& group_specs) {
  if (version < 0) return absl::InvalidArgumentError(absl::StrCat("an import's version must be >= 0, not ", version));
  for (const auto& [file, size] : files) FLATSHARD_RETURN_IF_ERROR(CheckImportedFileName(file));
  FLATSHARD_ASSIGN_OR_RETURN(const PrefixTensors model, ReadPrefix(dir, files, "model"));
  if (model.headers.empty()) {
    return absl::InvalidArgumentError("the import holds no model.safetensors (nor model.safetensors.index.json)");
  }
  if (model.order.empty()) return absl::InvalidArgumentError("the import's model files hold no tensor");
  FLATSHARD_ASSIGN_OR_RETURN(const PrefixTensors state, ReadPrefix(dir, files, "optimizer"));
  ImportedCheckpoint imported;
  imported.optimizer = !state.headers.empty();
  if (imported.optimizer) {
    FLATSHARD_ASSIGN_OR_RETURN(group_specs, OptimizerGroups(model, state, version));
  } else {
    Json tensors = Json::array();
    for (const SafetensorsTensor* tensor : model.order) tensors.push_back(TensorJson(*tensor));
    group_specs = Json::array({Json{{"name", "imported"},
                                    {"tensors", std::move(tensors)},
                                    {"version", version},
                                    {"optimizer", ""},
                                    {"optimizer_steps", 0},
                                    {"momentum_initialized", false},
                                    {"state", Json::array()}}});
  }
  for (const Json& group : group_specs) imported.groups.push_back(group.at("name").get<std::string>());
  return imported;
}

}  // namespace flatshard::server
