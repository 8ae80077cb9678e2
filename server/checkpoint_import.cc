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
#include "server/json_fields.h"
#include "server/sharded_index.h"

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

// Largest element count of one tensor a SHARDED import takes (products of its shape are
// checked against it before they could overflow).
constexpr int64_t kMaxNumel = int64_t{1} << 50;
// Most shard files a SHARDED import's description may announce.
constexpr int64_t kMaxShards = 1 << 20;

// `spec`'s field `key`, an integer in [0, 2^63) as a manifest's (server/json_fields.h);
// InvalidArgument naming it and `what` otherwise: the description came from a client.
absl::StatusOr<int64_t> CountField(const Json& spec, const char* key, const std::string& what) {
  absl::StatusOr<int64_t> value = NonNegativeInteger(spec, key, /*absent=*/-1, what);
  if (!value.ok()) return absl::InvalidArgumentError(value.status().message());
  if (*value < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": \"", key, "\" is missing"));
  return value;
}

// `spec`'s field `key` of JSON type `type`; InvalidArgument naming it and `what` otherwise.
absl::StatusOr<const Json*> TypedField(const Json& spec, const char* key, Json::value_t type, const char* type_name,
                                       const std::string& what) {
  const auto it = spec.find(key);
  if (it == spec.end() || it->type() != type) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has no '", key, "' ", type_name));
  }
  return &*it;
}

// A tensor of a SHARDED import's group, and the pieces its data must come in.
struct ShardedTensor {
  std::string key;  // "<group>/<fqn>", as the shard files name its pieces
  int64_t numel = 0;
};

// The groups a SHARDED import's description (kShardedDescriptionKey) lists, each field
// checked and written anew (the manifest holds nothing else); `tensors` gets every tensor,
// whose pieces must tile it, and `states` beside each the states its group lists, whose
// pieces must tile it too.
absl::StatusOr<Json> ShardedGroups(const Json& groups, std::vector<ShardedTensor>& tensors,
                                   std::vector<std::vector<std::string>>& states) {
  if (!groups.is_array() || groups.empty()) {
    return absl::InvalidArgumentError("the SHARDED description lists no groups (\"groups\": [...])");
  }
  Json specs = Json::array();
  std::set<std::string> names;
  for (const Json& group : groups) {
    if (!group.is_object()) return absl::InvalidArgumentError("a group of the SHARDED description is not an object");
    FLATSHARD_ASSIGN_OR_RETURN(const Json* name_field,
                               TypedField(group, "name", Json::value_t::string, "string", "a group"));
    const std::string name = name_field->get<std::string>();
    const std::string what = absl::StrCat("group '", name, "'");
    if (name.empty() || name.find('/') != std::string::npos || !names.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a group's name must be unique, not empty, without '/'"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t version, CountField(group, "version", what));
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t steps, CountField(group, "optimizer_steps", what));
    FLATSHARD_ASSIGN_OR_RETURN(const Json* optimizer,
                               TypedField(group, "optimizer", Json::value_t::string, "string", what));
    FLATSHARD_ASSIGN_OR_RETURN(const Json* momentum,
                               TypedField(group, "momentum_initialized", Json::value_t::boolean, "boolean", what));
    FLATSHARD_ASSIGN_OR_RETURN(const Json* state_field, TypedField(group, "state", Json::value_t::array, "list", what));
    std::vector<std::string> group_states;
    for (const Json& state : *state_field) {
      const bool known = state.is_string() && std::find(std::begin(kStates), std::end(kStates),
                                                        state.get<std::string>()) != std::end(kStates);
      if (!known || std::find(group_states.begin(), group_states.end(), state.get<std::string>()) !=
                        group_states.end()) {
        return absl::InvalidArgumentError(absl::StrCat(what, " lists optimizer state ", state.dump(), ": one of ",
                                                       Json(std::vector<std::string>(std::begin(kStates),
                                                                                     std::end(kStates))).dump(),
                                                       ", each once"));
      }
      group_states.push_back(state.get<std::string>());
    }
    FLATSHARD_ASSIGN_OR_RETURN(const Json* tensor_list,
                               TypedField(group, "tensors", Json::value_t::array, "list", what));
    if (tensor_list->empty()) return absl::InvalidArgumentError(absl::StrCat(what, " has no tensors"));
    Json group_tensors = Json::array();
    std::set<std::string> fqns;
    for (const Json& tensor : *tensor_list) {
      if (!tensor.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(what, " lists a tensor that is not an object"));
      }
      FLATSHARD_ASSIGN_OR_RETURN(const Json* fqn, TypedField(tensor, "name", Json::value_t::string, "string",
                                                             absl::StrCat("a tensor of ", what)));
      const std::string tensor_what = absl::StrCat("tensor '", fqn->get<std::string>(), "' of ", what);
      if (fqn->get<std::string>().empty() || !fqns.insert(fqn->get<std::string>()).second) {
        return absl::InvalidArgumentError(absl::StrCat(tensor_what, ": a tensor's name must be unique, not empty"));
      }
      FLATSHARD_ASSIGN_OR_RETURN(const Json* dtype_name, TypedField(tensor, "dtype", Json::value_t::string, "string",
                                                                    tensor_what));
      const absl::StatusOr<DType> dtype = ParseDType(dtype_name->get<std::string>());
      if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat(tensor_what, ": ", dtype.status().message()));
      FLATSHARD_ASSIGN_OR_RETURN(const Json* shape, TypedField(tensor, "shape", Json::value_t::array, "list",
                                                                tensor_what));
      std::vector<int64_t> dims;
      int64_t numel = 1;
      for (const Json& dim : *shape) {
        if (!dim.is_number_integer() || (dim.is_number_unsigned() && dim.get<uint64_t>() > kMaxNumel) ||
            dim.get<int64_t>() < 0 || (dim.get<int64_t>() > 0 && numel > kMaxNumel / dim.get<int64_t>())) {
          return absl::InvalidArgumentError(absl::StrCat(tensor_what, " has shape ", shape->dump(),
                                                         ": dimensions >= 0, at most 2^50 elements"));
        }
        dims.push_back(dim.get<int64_t>());
        numel *= dims.back();
      }
      tensors.push_back({absl::StrCat(name, "/", fqn->get<std::string>()), numel});
      group_tensors.push_back({{"name", *fqn}, {"shape", dims}, {"dtype", DTypeName(*dtype)}});
    }
    specs.push_back({{"name", name},
                     {"tensors", std::move(group_tensors)},
                     {"version", version},
                     {"optimizer", *optimizer},
                     {"optimizer_steps", steps},
                     {"momentum_initialized", *momentum},
                     {"state", group_states}});
    states.insert(states.end(), tensor_list->size(), group_states);
  }
  return specs;
}

// Checks that the pieces `index` lists tile each of `tensors` (with its `states`) exactly
// and are of nothing else.
absl::Status CheckPiecesTile(const ShardedIndex& index, const std::vector<ShardedTensor>& tensors,
                             const std::vector<std::vector<std::string>>& states) {
  size_t matched = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    std::vector<std::string> keys = {tensors[t].key};
    for (const std::string& state : states[t]) keys.push_back(absl::StrCat(tensors[t].key, ".", state));
    for (const std::string& key : keys) {
      auto found = index.find(key);
      std::vector<StoredPiece> pieces;
      if (found != index.end()) {
        pieces = found->second;
        ++matched;
      }
      std::sort(pieces.begin(), pieces.end(),
                [](const StoredPiece& a, const StoredPiece& b) { return a.intra_start < b.intra_start; });
      int64_t next = 0;  // the first element not covered yet
      for (const StoredPiece& piece : pieces) {
        if (piece.intra_start != next) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the shard files hold elements [", std::min(next, piece.intra_start), ", ",
              std::max(next, piece.intra_start), ") of '", key, "' ", piece.intra_start > next ? "in none" : "twice"));
        }
        next += piece.numel;
      }
      if (next != tensors[t].numel) {
        return absl::InvalidArgumentError(absl::StrCat("the shard files hold ", next, " elements of '", key,
                                                       "', whose tensor has ", tensors[t].numel));
      }
    }
  }
  if (matched != index.size()) {
    std::set<std::string> described;
    for (size_t t = 0; t < tensors.size(); ++t) {
      described.insert(tensors[t].key);
      for (const std::string& state : states[t]) described.insert(absl::StrCat(tensors[t].key, ".", state));
    }
    for (const auto& [key, pieces] : index) {
      if (described.count(key) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the shard files hold pieces of '", key, "', which the description lists no tensor (or state) for"));
      }
    }
  }
  return absl::OkStatus();
}

// A SHARDED export's shard files (every one of `files`), described by shard 0.
absl::StatusOr<ImportedCheckpoint> DescribeShardedImport(const std::string& dir,
                                                         const std::map<std::string, uint64_t>& files,
                                                         bool weights_only, Json& group_specs) {
  const std::string first = ShardFileName(0);
  if (files.count(first) == 0) return absl::InvalidArgumentError(absl::StrCat("the import lacks '", first, "'"));
  absl::StatusOr<SafetensorsHeader> header = SafetensorsHeader::Read(dir + "/" + first);
  if (!header.ok()) return absl::InvalidArgumentError(header.status().message());
  auto text = header->metadata().find(kShardedDescriptionKey);
  if (text == header->metadata().end()) {
    return absl::InvalidArgumentError(absl::StrCat("'", first, "' has no '", kShardedDescriptionKey,
                                                   "' metadata: not a SHARDED export (or one older than imports)"));
  }
  const Json description = Json::parse(text->second, nullptr, /*allow_exceptions=*/false);
  const std::string what = absl::StrCat("'", first, "' metadata '", kShardedDescriptionKey, "'");
  if (!description.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, " is not a JSON object"));
  FLATSHARD_ASSIGN_OR_RETURN(const int64_t shards, CountField(description, "shards", what));
  FLATSHARD_ASSIGN_OR_RETURN(const Json* optimizer,
                             TypedField(description, "optimizer", Json::value_t::boolean, "boolean", what));
  if (shards < 1 || shards > kMaxShards) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shards must be between 1 and ", kMaxShards));
  }
  std::vector<std::string> shard_files;
  for (int index = 0; index < shards; ++index) {
    shard_files.push_back(ShardFileName(index));
    if (files.count(shard_files.back()) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the import lacks '", shard_files.back(), "' of the ", shards, " shard files"));
    }
  }
  if (files.size() != shard_files.size()) {
    for (const auto& [file, size] : files) {
      if (std::find(shard_files.begin(), shard_files.end(), file) == shard_files.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the import holds '", file, "' beside the ", shards, " shard files of a SHARDED state dict"));
      }
    }
  }
  std::vector<ShardedTensor> tensors;
  std::vector<std::vector<std::string>> states;
  FLATSHARD_ASSIGN_OR_RETURN(group_specs, ShardedGroups(description.value("groups", Json()), tensors, states));
  // The index as a SHARDED save's commit writes it: every header read and checked.
  absl::StatusOr<std::string> index_json = ShardedIndexJson(dir, shard_files);
  if (!index_json.ok()) return absl::InvalidArgumentError(index_json.status().message());
  FLATSHARD_ASSIGN_OR_RETURN(const ShardedIndex index, ParseShardedIndex(*index_json, "index.json"));
  FLATSHARD_RETURN_IF_ERROR(CheckPiecesTile(index, tensors, states));
  ImportedCheckpoint imported;
  imported.kind = CheckpointKind::kSharded;
  imported.optimizer = optimizer->get<bool>() && !weights_only;
  imported.shards = static_cast<int>(shards);
  imported.index_json = *std::move(index_json);
  for (const Json& group : group_specs) imported.groups.push_back(group.at("name").get<std::string>());
  if (!imported.optimizer) {  // the state's pieces stay in the files, unread
    for (Json& spec : group_specs) {
      spec["state"] = Json::array();
      spec["optimizer_steps"] = 0;
      spec["momentum_initialized"] = false;
    }
  }
  return imported;
}

}  // namespace

absl::Status CheckImportedFileName(const std::string& file) {
  if (IsStateDictFileName(file) || IsShardFileName(file)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("'", file, "' is not a file of a FULL state dict (model.safetensors, model-<i>-of-<n>.safetensors, ",
                   "model.safetensors.index.json, and the same for optimizer) nor of a SHARDED one ",
                   "(shard-<i>.safetensors)"));
}

absl::StatusOr<ImportedCheckpoint> DescribeImport(const std::string& dir, const std::map<std::string, uint64_t>& files,
                                                  int64_t version, bool weights_only, Json& group_specs) {
  if (version < 0) return absl::InvalidArgumentError(absl::StrCat("an import's version must be >= 0, not ", version));
  for (const auto& [file, size] : files) FLATSHARD_RETURN_IF_ERROR(CheckImportedFileName(file));
  const bool sharded = std::any_of(files.begin(), files.end(), [](const auto& file) {
    return IsShardFileName(file.first);
  });
  if (sharded) return DescribeShardedImport(dir, files, weights_only, group_specs);
  FLATSHARD_ASSIGN_OR_RETURN(const PrefixTensors model, ReadPrefix(dir, files, "model"));
  if (model.headers.empty()) {
    return absl::InvalidArgumentError("the import holds no model.safetensors (nor model.safetensors.index.json)");
  }
  if (model.order.empty()) return absl::InvalidArgumentError("the import's model files hold no tensor");
  FLATSHARD_ASSIGN_OR_RETURN(const PrefixTensors state, ReadPrefix(dir, files, "optimizer"));
  if (weights_only && !state.headers.empty()) {
    return absl::InvalidArgumentError("the import is of weights only, but optimizer files came with it");
  }
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
