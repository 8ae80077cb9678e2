#include "server/checkpoint_loader.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "server/checkpoint_writer.h"
#include "server/host_slab.h"
#include "server/json_fields.h"
#include "server/sharded_index.h"

namespace flatshard::server {

using Json = nlohmann::json;

absl::StatusOr<std::map<std::string, ManifestFile>> ManifestFiles(const Json& manifest, const std::string& where) {
  std::map<std::string, ManifestFile> files;
  if (!manifest.contains("files") || !manifest["files"].is_array()) {
    return absl::DataLossError(absl::StrCat("'", where, "/manifest.json' lacks its file list"));
  }
  for (const Json& entry : manifest["files"]) {
    const std::string path = entry.value("path", "");
    const std::string what = absl::StrCat("'", where, "/manifest.json' file '", path, "'");
    ManifestFile file;
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t bytes, NonNegativeInteger(entry, "bytes", 0, what));
    file.bytes = static_cast<uint64_t>(bytes);
    FLATSHARD_ASSIGN_OR_RETURN(file.extents, ExtentsFromJson(entry.value("extents", Json()), what));
    if (absl::Status tiled = SortAndCheckTiling(file.extents, file.bytes, what); !tiled.ok()) {
      return absl::DataLossError(tiled.message());
    }
    files[path] = std::move(file);
  }
  return files;
}

absl::StatusOr<StagedGroups> StageCheckpoint(const Json& manifest, CheckpointReader& reader, const Registry& registry,
                                             const std::string& name, const std::string& job, int rank,
                                             int num_servers, ProgressCounter* progress) {
  const absl::StatusOr<CheckpointKind> kind_or = ParseCheckpointKind(manifest.value("kind", ""));
  if (!kind_or.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint '", name, "' manifest: ", kind_or.status().message()));
  }
  const CheckpointKind kind = *kind_or;
  const bool optimizer = manifest.value("optimizer", false);
  const std::string what = absl::StrCat("checkpoint '", name, "' manifest");
  FLATSHARD_ASSIGN_OR_RETURN(const int64_t servers, NonNegativeInteger(manifest, "servers", 0, what));
  if (kind == CheckpointKind::kLocal && servers != num_servers) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name, "' is LOCAL from ", servers,
                                                      " servers; this cluster has ", num_servers,
                                                      " (save FULL or SHARDED to change the server count)"));
  }
  // A per-server root's manifest lists only this server's own files.
  FLATSHARD_ASSIGN_OR_RETURN(const int64_t part_rank, NonNegativeInteger(manifest, "rank", -1, what));
  if (manifest.value("root", "") == "per-server" && part_rank != rank) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name, "' in this server's root holds server ",
                                                      part_rank, "'s part; this server is rank ", rank));
  }
  const bool split_model = reader.lists("model.safetensors.index.json");
  const bool split_optimizer = reader.lists("optimizer.safetensors.index.json");
  // Verified JSON of the checkpoint (indexes), once.
  std::map<std::string, Json> json_files;
  auto read_json = [&](const std::string& file) -> absl::StatusOr<const Json*> {
    if (auto it = json_files.find(file); it != json_files.end()) return &it->second;
    FLATSHARD_ASSIGN_OR_RETURN(const std::string text, reader.ReadWhole(file));
    try {
      return &json_files.emplace(file, Json::parse(text)).first->second;
    } catch (const Json::exception& error) {  // parse_error, or out_of_range for a number like 1e999
      return absl::DataLossError(absl::StrCat("'", reader.path(file), "' is not valid JSON: ", error.what()));
    }
  };
  // Verified safetensors headers, once.
  std::map<std::string, SafetensorsHeader> headers;
  auto header_of = [&](const std::string& file) -> absl::StatusOr<const SafetensorsHeader*> {
    if (auto it = headers.find(file); it != headers.end()) return &it->second;
    FLATSHARD_ASSIGN_OR_RETURN(SafetensorsHeader header, reader.ReadHeader(file));
    return &headers.emplace(file, std::move(header)).first->second;
  };
  // FULL: the file holding a tensor ("<prefix>.safetensors", or the one the
  // "<prefix>.safetensors.index.json" of a split checkpoint names).
  auto full_file_of = [&](const std::string& prefix, const std::string& tensor) -> absl::StatusOr<std::string> {
    const std::string index_file = prefix + ".safetensors.index.json";
    if (!(prefix == "model" ? split_model : split_optimizer)) return prefix + ".safetensors";
    FLATSHARD_ASSIGN_OR_RETURN(const Json* index, read_json(index_file));
    const Json* map = index->is_object() && index->contains("weight_map") ? &(*index)["weight_map"] : nullptr;
    if (map == nullptr || !map->is_object() || !map->contains(tensor) || !(*map)[tensor].is_string()) {
      return absl::DataLossError(absl::StrCat("'", reader.path(index_file), "' does not map tensor '", tensor, "'"));
    }
    return (*map)[tensor].get<std::string>();
  };

  // SHARDED: where every stored piece lives, from the checkpoint's index.json.
  ShardedIndex stored;
  if (kind == CheckpointKind::kSharded) {
    FLATSHARD_ASSIGN_OR_RETURN(const std::string text, reader.ReadWhole("index.json"));
    FLATSHARD_ASSIGN_OR_RETURN(stored, ParseShardedIndex(text, reader.path("index.json")));
  }

  std::vector<std::pair<std::shared_ptr<Group>, LoadedShard>> staged;
  HostSlab slab;  // the staging buffers of small groups, a few blocks instead of a malloc each
  std::set<std::string> in_checkpoint;
  for (const Json& spec : manifest.at("groups")) {
    const std::string group_name = spec.value("name", "");
    in_checkpoint.insert(group_name);
    absl::StatusOr<std::shared_ptr<Group>> group_or = registry.FindGroup(job, group_name);
    if (!group_or.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name, "' has group '", group_name,
                                                        "', which is not registered in job '", job, "'"));
    }
    const std::shared_ptr<Group>& group = *group_or;
    const FlatLayout& layout = group->layout();
    const std::string group_what = absl::StrCat("checkpoint '", name, "' group '", group_name, "'");
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t align, NonNegativeInteger(spec, "align", -1, group_what));
    if (spec.at("tensors") != TensorsJson(layout) || align != layout.align()) {
      return absl::FailedPreconditionError(absl::StrCat(group_what, " does not match the registered group: checkpoint ",
                                                        spec.at("tensors").dump(), " align ", align, "; registered ",
                                                        TensorsJson(layout).dump(), " align ", layout.align()));
    }
    std::vector<std::string> state_names;
    if (optimizer) {
      for (const auto& s : spec.at("state")) state_names.push_back(s.get<std::string>());
      if (state_names != group->optimizer_state_names()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", name, "' group '", group_name, "' has ", spec.value("optimizer", ""),
            " optimizer state; the registered group uses ", group->optimizer_name()));
      }
    }
    // Host buffers that a host-tier group adopts on commit (Group::Restore).
    LoadedShard loaded;
    FLATSHARD_ASSIGN_OR_RETURN(loaded.version, NonNegativeInteger(spec, "version", 0, group_what));
    FLATSHARD_ASSIGN_OR_RETURN(loaded.optimizer_steps, NonNegativeInteger(spec, "optimizer_steps", 0, group_what));
    loaded.momentum_initialized = spec.value("momentum_initialized", false);
    const size_t shard_numel = static_cast<size_t>(layout.shard_numel());
    const std::string what = absl::StrCat("loading group '", group_name, "'");
    FLATSHARD_ASSIGN_OR_RETURN(loaded.params, slab.Allocate(shard_numel * sizeof(float), what));
    for (const std::string& state : group->optimizer_state_names()) {
      FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer buffer, slab.Allocate(shard_numel * sizeof(float), what));
      loaded.state.emplace_back(state, std::move(buffer));
    }
    // The buffers are unwritten: the reads fill every tensor element, padding is zeroed here.
    const int64_t start = layout.shard_start(rank);
    const std::vector<TensorPiece> pieces = layout.MapRange(start, layout.shard_end(rank));
    auto zero_padding = [&](float* values) {
      int64_t at = 0;
      for (const TensorPiece& piece : pieces) {
        std::fill(values + at, values + (piece.flat_offset - start), 0.0f);
        at = piece.flat_offset - start + piece.numel;
      }
      std::fill(values + at, values + shard_numel, 0.0f);
    };
    zero_padding(loaded.params.floats());
    for (auto& [state, values] : loaded.state) {
      if (optimizer) {
        zero_padding(values.floats());
      } else {  // a checkpoint without optimizer state: the optimizer starts afresh
        std::fill_n(values.floats(), shard_numel, 0.0f);
      }
    }

    std::vector<std::pair<std::string, float*>> targets = {{"", loaded.params.floats()}};
    if (optimizer) {
      for (auto& [state, values] : loaded.state) targets.emplace_back("." + state, values.floats());
    }
    for (const auto& [suffix, values] : targets) {
      if (kind == CheckpointKind::kLocal) {
        const std::string file = absl::StrCat("local-", rank, ".safetensors");
        FLATSHARD_ASSIGN_OR_RETURN(const SafetensorsHeader* header, header_of(file));
        const std::string tensor = group_name + (suffix.empty() ? ".params" : suffix);
        const SafetensorsTensor* entry = header->Find(tensor);
        if (entry == nullptr || entry->dtype != DType::kFloat32 ||
            entry->end - entry->begin != shard_numel * sizeof(float)) {
          return absl::DataLossError(
              absl::StrCat("'", reader.path(file), "' lacks '", tensor, "' of ", shard_numel, " floats"));
        }
        FLATSHARD_RETURN_IF_ERROR(reader.Add(file, header->data_start() + entry->begin, DType::kFloat32,
                                             static_cast<int64_t>(shard_numel), values));
        continue;
      }
      for (const TensorPiece& piece : pieces) {
        const TensorSpec& tensor = layout.tensor(piece.tensor_index);
        float* out = values + (piece.flat_offset - start);
        if (kind == CheckpointKind::kFull) {
          const std::string tensor_name = tensor.fqn + suffix;
          FLATSHARD_ASSIGN_OR_RETURN(const std::string file,
                                     full_file_of(suffix.empty() ? "model" : "optimizer", tensor_name));
          FLATSHARD_ASSIGN_OR_RETURN(const SafetensorsHeader* header, header_of(file));
          const SafetensorsTensor* entry = header->Find(tensor_name);
          if (entry == nullptr) {
            return absl::DataLossError(absl::StrCat("'", reader.path(file), "' lacks tensor '", tensor_name, "'"));
          }
          if (entry->shape != tensor.shape || (suffix.empty() && entry->dtype != tensor.dtype) ||
              (!suffix.empty() && entry->dtype != DType::kFloat32)) {
            return absl::FailedPreconditionError(absl::StrCat("'", reader.path(file), "' tensor '", tensor_name,
                                                              "' has another shape or dtype than registered"));
          }
          const uint64_t element = DTypeSize(entry->dtype);
          FLATSHARD_RETURN_IF_ERROR(reader.Add(file,
                                               header->data_start() + entry->begin +
                                                   static_cast<uint64_t>(piece.intra_start) * element,
                                               entry->dtype, piece.numel, out));
          continue;
        }
        // SHARDED: every overlap of a stored piece with the needed range.
        int64_t covered = 0;
        for (const StoredPiece& s : stored[absl::StrCat(group_name, "/", tensor.fqn, suffix)]) {
          const int64_t lo = std::max(piece.intra_start, s.intra_start);
          const int64_t hi = std::min(piece.intra_start + piece.numel, s.intra_start + s.numel);
          if (lo >= hi) continue;
          FLATSHARD_RETURN_IF_ERROR(reader.Add(s.file, s.offset + static_cast<uint64_t>(lo - s.intra_start) * sizeof(float),
                                               DType::kFloat32, hi - lo, out + (lo - piece.intra_start)));
          covered += hi - lo;
        }
        if (covered != piece.numel) {
          return absl::DataLossError(absl::StrCat("checkpoint '", name, "' lacks elements of '", group_name, "/",
                                                  tensor.fqn, suffix, "' [", piece.intra_start, ", ",
                                                  piece.intra_start + piece.numel, ")"));
        }
      }
    }
    staged.emplace_back(group, std::move(loaded));
  }
  for (const auto& group : registry.job_groups(job)) {
    if (!in_checkpoint.count(group->name())) {
      return absl::FailedPreconditionError(absl::StrCat("group '", group->name(), "' of job '", job,
                                                        "' is not in checkpoint '", name, "'"));
    }
  }
  FLATSHARD_RETURN_IF_ERROR(reader.Run(progress));
  return staged;
}

}  // namespace flatshard::server
