#include "server/checkpoint_loader.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
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

namespace {

// A group of the checkpoint, as its manifest describes it.
struct CheckpointGroup {
  std::string name;
  int64_t align = 0;
  int64_t version = 0;
  int64_t optimizer_steps = 0;
  bool momentum_initialized = false;
  std::string optimizer;
  std::vector<std::string> state;  // optimizer state names (none in a checkpoint without them)
  const Json* tensors = nullptr;   // [{"name", "shape", "dtype"}], in layout order
};

// The tensors a checkpoint holds, by group and name, and which registered group takes
// each: a registered tensor comes from the checkpoint group of its own group's name that
// holds it, else from the one checkpoint group holding a tensor of its name (models
// wrapped otherwise, param groups added or removed: FULL and SHARDED checkpoints load by
// tensor). Not thread-safe.
class CheckpointTensors {
 public:
  struct Tensor {
    size_t group;       // in groups()
    const Json* spec;   // {"name", "shape", "dtype"}
    std::string taker;  // the registered group that loads it; empty while none
  };

  // `non_strict`: registered tensors the checkpoint lacks are not an error (Take), nor are
  // its tensors no group takes (Untaken).
  static absl::StatusOr<CheckpointTensors> Parse(const Json& manifest, const std::string& name, bool non_strict) {
    CheckpointTensors contents;
    contents.name_ = name;
    contents.non_strict_ = non_strict;
    for (const Json& spec : manifest.at("groups")) {
      CheckpointGroup group;
      group.name = spec.value("name", "");
      const std::string what = absl::StrCat("checkpoint '", name, "' group '", group.name, "'");
      FLATSHARD_ASSIGN_OR_RETURN(group.align, NonNegativeInteger(spec, "align", -1, what));
      FLATSHARD_ASSIGN_OR_RETURN(group.version, NonNegativeInteger(spec, "version", 0, what));
      FLATSHARD_ASSIGN_OR_RETURN(group.optimizer_steps, NonNegativeInteger(spec, "optimizer_steps", 0, what));
      group.momentum_initialized = spec.value("momentum_initialized", false);
      group.optimizer = spec.value("optimizer", "");
      for (const Json& state : spec.at("state")) group.state.push_back(state.get<std::string>());
      group.tensors = &spec.at("tensors");
      if (!contents.group_index_.emplace(group.name, contents.groups_.size()).second) {
        return absl::DataLossError(absl::StrCat(what, " is listed twice"));
      }
      for (const Json& tensor : *group.tensors) {
        contents.by_name_[tensor.at("name").get<std::string>()].push_back(contents.tensors_.size());
        contents.tensors_.push_back({contents.groups_.size(), &tensor, ""});
      }
      contents.groups_.push_back(std::move(group));
    }
    return contents;
  }

  const std::vector<CheckpointGroup>& groups() const { return groups_; }
  // The checkpoint group named `name`, or null.
  const CheckpointGroup* group(const std::string& name) const {
    auto it = group_index_.find(name);
    return it == group_index_.end() ? nullptr : &groups_[it->second];
  }

  // The checkpoint's tensor for `tensor` (as TensorsJson describes it) of registered
  // group `group`, which takes it; null if the checkpoint lacks it and the load is
  // non-strict. FailedPrecondition if the checkpoint lacks it (strict), holds it with
  // another shape or dtype, holds it only in several other groups, or another registered
  // group took it already.
  absl::StatusOr<const Tensor*> Take(const std::string& group, const std::string& job, const Json& tensor) {
    const std::string fqn = tensor.at("name").get<std::string>();
    // For messages only: a load of many small groups takes tens of thousands of tensors.
    auto registered = [&] { return absl::StrCat("group '", group, "' of job '", job, "'"); };
    auto named = by_name_.find(fqn);
    if (named == by_name_.end()) {
      if (non_strict_) return nullptr;
      return absl::FailedPreconditionError(
          absl::StrCat("tensor '", fqn, "' of ", registered(), " is not in checkpoint '", name_, "'"));
    }
    const std::vector<size_t>& holders = named->second;
    auto own = std::find_if(holders.begin(), holders.end(),
                            [&](size_t index) { return groups_[tensors_[index].group].name == group; });
    if (own == holders.end() && holders.size() > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", name_, "' holds tensor '", fqn, "' in groups '", groups_[tensors_[holders[0]].group].name,
          "' and '", groups_[tensors_[holders[1]].group].name, "', none of them ", registered(),
          ": which one it takes is ambiguous"));
    }
    Tensor& source = tensors_[own != holders.end() ? *own : holders.front()];
    const std::string& source_group = groups_[source.group].name;
    if (*source.spec != tensor) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name_, "' group '", source_group,
                                                        "' holds tensor ", source.spec->dump(), "; ", registered(),
                                                        " registers it as ", tensor.dump()));
    }
    if (!source.taker.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("tensor '", fqn, "' of checkpoint '", name_, "' group '",
                                                        source_group, "' would load into groups '", source.taker,
                                                        "' and '", group, "' of job '", job, "'"));
    }
    source.taker = group;
    return &source;
  }

  // The tensors no registered group took, in the manifest's order (a non-strict load
  // skips them). FailedPrecondition naming the first, unless the load is non-strict.
  absl::StatusOr<std::vector<std::string>> Untaken(const std::string& job) const {
    std::vector<std::string> untaken;
    for (const Tensor& tensor : tensors_) {
      if (!tensor.taker.empty()) continue;
      const std::string fqn = tensor.spec->at("name").get<std::string>();
      if (!non_strict_) {
        return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name_, "' has tensor '", fqn, "' (group '",
                                                          groups_[tensor.group].name, "'), which no group of job '",
                                                          job, "' registers"));
      }
      untaken.push_back(fqn);
    }
    return untaken;
  }

 private:
  std::string name_;
  bool non_strict_ = false;
  std::vector<CheckpointGroup> groups_;
  std::vector<Tensor> tensors_;
  absl::flat_hash_map<std::string, size_t> group_index_;
  absl::flat_hash_map<std::string, std::vector<size_t>> by_name_;  // tensors_ holding each name
};

// The version, optimizer steps and state that `group` loads: those of the checkpoint
// groups its tensors come from (`sources`), which must agree. FailedPrecondition
// otherwise, or if their optimizer state is not the one `group` keeps.
absl::Status LoadedCounters(const std::string& name, const Group& group,
                            const std::vector<const CheckpointGroup*>& sources, bool optimizer,
                            LoadedShard& loaded) {
  const CheckpointGroup& first = *sources.front();
  for (const CheckpointGroup* source : sources) {
    if (optimizer && source->state != group.optimizer_state_names()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name, "' group '", source->name, "' has ",
                                                        source->optimizer, " optimizer state; group '", group.name(),
                                                        "' uses ", group.optimizer_name()));
    }
    if (source->version != first.version || source->optimizer_steps != first.optimizer_steps ||
        source->momentum_initialized != first.momentum_initialized) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group '", group.name(), "' would load tensors of checkpoint '", name, "' groups '", first.name,
          "' (version ", first.version, ", ", first.optimizer_steps, " optimizer steps) and '", source->name,
          "' (version ", source->version, ", ", source->optimizer_steps,
          " optimizer steps): a group loads from groups saved at one step"));
    }
  }
  loaded.version = first.version;
  loaded.optimizer_steps = first.optimizer_steps;
  loaded.momentum_initialized = first.momentum_initialized;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StagedCheckpoint> StageCheckpoint(const Json& manifest, CheckpointReader& reader,
                                                 const Registry& registry, const std::string& name,
                                                 const std::string& job, int rank, int num_servers, bool non_strict,
                                                 ProgressCounter* progress) {
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

  FLATSHARD_ASSIGN_OR_RETURN(CheckpointTensors contents, CheckpointTensors::Parse(manifest, name, non_strict));
  StagedCheckpoint staged;
  HostSlab slab;  // the staging buffers of small groups, a few blocks instead of a malloc each
  // Host buffers for `group`'s shard, that a host-tier group adopts on commit (Restore).
  auto allocate = [&slab](const Group& group, LoadedShard& loaded) -> absl::Status {
    const size_t bytes = static_cast<size_t>(group.layout().shard_numel()) * sizeof(float);
    const std::string what = absl::StrCat("loading group '", group.name(), "'");
    FLATSHARD_ASSIGN_OR_RETURN(loaded.params, slab.Allocate(bytes, what));
    for (const std::string& state : group.optimizer_state_names()) {
      FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer buffer, slab.Allocate(bytes, what));
      loaded.state.emplace_back(state, std::move(buffer));
    }
    return absl::OkStatus();
  };
  std::vector<std::shared_ptr<Group>> unsaved;  // trained groups the checkpoint holds nothing of
  for (const std::shared_ptr<Group>& group : registry.job_groups(job)) {
    const std::string& group_name = group->name();
    const FlatLayout& layout = group->layout();
    const Json registered = TensorsJson(layout);
    if (kind == CheckpointKind::kLocal && non_strict && contents.group(group_name) == nullptr) {
      for (const Json& tensor : registered) staged.omitted.missing.push_back(tensor.at("name").get<std::string>());
      if (!group->frozen()) unsaved.push_back(group);
      continue;
    }
    if (kind == CheckpointKind::kLocal) {  // flat shards as they were: the same groups only
      const CheckpointGroup* same = contents.group(group_name);
      if (same == nullptr || *same->tensors != registered || same->align != layout.align()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", name, "' is LOCAL and ",
            same == nullptr ? "has no group '" + group_name + "'"
                            : absl::StrCat("its group '", group_name, "' (", same->tensors->dump(), " align ",
                                           same->align, ") is not as registered (", registered.dump(), " align ",
                                           layout.align(), ")"),
            " (save FULL or SHARDED to load into other groups)"));
      }
    }
    // Where each registered tensor comes from: a checkpoint group's tensor of its name
    // (null: a non-strict load keeps it).
    std::vector<const CheckpointTensors::Tensor*> sources;
    std::vector<const CheckpointGroup*> source_groups;
    size_t kept_tensors = 0;
    for (const Json& tensor : registered) {
      FLATSHARD_ASSIGN_OR_RETURN(const CheckpointTensors::Tensor* source, contents.Take(group_name, job, tensor));
      sources.push_back(source);
      if (source == nullptr) {
        staged.omitted.missing.push_back(tensor.at("name").get<std::string>());
        ++kept_tensors;
        continue;
      }
      const CheckpointGroup* source_group = &contents.groups()[source->group];
      if (std::find(source_groups.begin(), source_groups.end(), source_group) == source_groups.end()) {
        source_groups.push_back(source_group);
      }
    }
    if (kept_tensors == sources.size() && kept_tensors > 0) {  // nothing of it saved
      if (!group->frozen()) unsaved.push_back(group);
      continue;
    }
    LoadedShard loaded;
    if (!source_groups.empty()) {
      FLATSHARD_RETURN_IF_ERROR(LoadedCounters(name, *group, source_groups, optimizer, loaded));
    }
    const size_t shard_numel = static_cast<size_t>(layout.shard_numel());
    FLATSHARD_RETURN_IF_ERROR(allocate(*group, loaded));
    // The buffers are unwritten: the reads fill every loaded tensor element, Restore the
    // kept ones, padding is zeroed here.
    const int64_t start = layout.shard_start(rank);
    const std::vector<TensorPiece> pieces = layout.MapRange(start, layout.shard_end(rank));
    // The pieces of kept tensors: Restore fills them from the group's current state.
    std::vector<ShardRange> kept;
    for (const TensorPiece& piece : pieces) {
      if (sources[static_cast<size_t>(piece.tensor_index)] != nullptr) continue;
      const int64_t begin = piece.flat_offset - start;
      if (!kept.empty() && kept.back().end == begin) {
        kept.back().end = begin + piece.numel;
      } else {
        kept.push_back({begin, begin + piece.numel});
      }
    }
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
        if (sources[static_cast<size_t>(piece.tensor_index)] == nullptr) continue;  // kept
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
        // SHARDED: every overlap of a stored piece (of the tensor's checkpoint group) with
        // the needed range.
        const std::string stored_name = absl::StrCat(
            contents.groups()[sources[static_cast<size_t>(piece.tensor_index)]->group].name, "/", tensor.fqn, suffix);
        int64_t covered = 0;
        for (const StoredPiece& s : stored[stored_name]) {
          const int64_t lo = std::max(piece.intra_start, s.intra_start);
          const int64_t hi = std::min(piece.intra_start + piece.numel, s.intra_start + s.numel);
          if (lo >= hi) continue;
          FLATSHARD_RETURN_IF_ERROR(reader.Add(s.file, s.offset + static_cast<uint64_t>(lo - s.intra_start) * sizeof(float),
                                               DType::kFloat32, hi - lo, out + (lo - piece.intra_start)));
          covered += hi - lo;
        }
        if (covered != piece.numel) {
          return absl::DataLossError(absl::StrCat("checkpoint '", name, "' lacks elements of '", stored_name, "' [",
                                                  piece.intra_start, ", ", piece.intra_start + piece.numel, ")"));
        }
      }
    }
    staged.groups.push_back(
        {group, std::move(loaded), {.ranges = std::move(kept), .optimizer_counters = false, .version = false}});
  }
  // The trained groups the checkpoint holds nothing of keep their state, but are
  // installed all the same, as every trained group of a load is: the steps in progress
  // start over from the loaded state (the job's clipping norms of those steps go with
  // the load). Their version becomes that of the loaded trained groups when these agree
  // (as a save's cut makes them), so that the job's trained groups step on together.
  std::set<int64_t> loaded_versions;
  for (const StagedGroup& group : staged.groups) {
    if (!group.group->frozen()) loaded_versions.insert(group.shard.version);
  }
  for (const std::shared_ptr<Group>& group : unsaved) {
    LoadedShard loaded;
    const bool own_version = loaded_versions.size() != 1;
    if (!own_version) loaded.version = *loaded_versions.begin();
    FLATSHARD_RETURN_IF_ERROR(allocate(*group, loaded));
    staged.groups.push_back({group,
                             std::move(loaded),
                             {.ranges = {{0, group->layout().shard_numel()}},
                              .optimizer_counters = true,
                              .version = own_version}});
  }
  FLATSHARD_ASSIGN_OR_RETURN(staged.omitted.unexpected, contents.Untaken(job));
  FLATSHARD_RETURN_IF_ERROR(reader.Run(progress));
  return staged;
}

}  // namespace flatshard::server
