#include "server/checkpoint_writer.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/safetensors.h"
#include "core/state_dict_files.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"

namespace flatshard::server {
namespace {

using Json = nlohmann::json;

absl::Span<const std::byte> Bytes(const std::vector<std::byte>& v) { return absl::MakeConstSpan(v); }
absl::Span<const std::byte> Bytes(absl::Span<const float> v) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float));
}

Json GroupJson(const Group& group, const ShardSnapshot& snapshot, bool optimizer) {
  Json state = Json::array();
  if (optimizer) {
    for (const auto& [name, values] : snapshot.state) state.push_back(name);
  }
  return {{"name", group.name()},
          {"align", group.layout().align()},
          {"tensors", TensorsJson(group.layout())},
          {"version", snapshot.version},
          {"optimizer", group.optimizer_name()},
          {"optimizer_steps", optimizer ? snapshot.optimizer_steps : 0},
          {"momentum_initialized", optimizer && snapshot.momentum_initialized},
          {"state", state}};
}

// Elements converted and written at a time: bounds the memory of a save or export.
constexpr int64_t kSliceElements = int64_t{1} << 20;

// Writes tensor bytes and counts them in `progress` (when given) once `sink` took them:
// the progress of a save is its tensor bytes (PartBytes), headers aside.
absl::Status WriteTensorBytes(CheckpointSink& sink, const std::string& file, uint64_t offset,
                              absl::Span<const std::byte> data, ProgressCounter* progress) {
  FLATSHARD_RETURN_IF_ERROR(sink.Write(file, offset, data));
  if (progress != nullptr) progress->done += data.size();
  return absl::OkStatus();
}

// One of a shard's arrays written into a FULL file: the parameters (state "", tensors
// by their fqns) or an optimizer state (tensors "<fqn>.<state>").
struct FullArray {
  std::string state;
  std::string tensor_suffix;
};

// Writes the pieces of `shard` that `file` holds, of each of `arrays`, piece by piece and
// for each piece array by array: the order of the file's tensors (WriteFull lays out
// each tensor's arrays one after the other), so that a server's writes of consecutive
// tensors join into runs.
absl::Status WritePieces(CheckpointSink& sink, const std::string& file, const SafetensorsHeader& header,
                         const SavedShard& shard, const std::vector<FullArray>& arrays, ProgressCounter* progress) {
  const FlatLayout& layout = shard.group->layout();
  std::vector<float> values;
  std::vector<std::byte> converted;
  for (const TensorPiece& piece : shard.pieces) {
    const TensorSpec& spec = layout.tensor(piece.tensor_index);
    for (const FullArray& array : arrays) {
      const SafetensorsTensor* entry = header.Find(spec.fqn + array.tensor_suffix);
      if (entry == nullptr) continue;  // in another file of a split FULL checkpoint
      const size_t element = DTypeSize(entry->dtype);
      for (int64_t done = 0; done < piece.numel; done += kSliceElements) {
        const int64_t count = std::min(kSliceElements, piece.numel - done);
        values.resize(static_cast<size_t>(count));
        FLATSHARD_RETURN_IF_ERROR(
            shard.Read(array.state, piece.flat_offset - shard.start + done, count, values.data()));
        converted.resize(static_cast<size_t>(count) * element);
        FLATSHARD_RETURN_IF_ERROR(
            kernels::cpu::Cast(DType::kFloat32, values.data(), entry->dtype, converted.data(), count));
        FLATSHARD_RETURN_IF_ERROR(WriteTensorBytes(
            sink, file, header.data_start() + entry->begin + static_cast<uint64_t>(piece.intra_start + done) * element,
            Bytes(converted), progress));
      }
    }
  }
  return absl::OkStatus();
}

// FULL: every server fills its byte ranges of the shared files.
struct Output {
  std::string file;
  std::vector<SafetensorsTensor> tensors;
  bool is_state;
};

// Splits `tensors` into files of at most `max_file_bytes` of data each (a larger tensor
// gets a file of its own), named like Hugging Face's: "<prefix>.safetensors" when one
// file suffices, else "<prefix>-00001-of-0000N.safetensors".
std::vector<Output> SplitFiles(const std::string& prefix, const std::vector<SafetensorsTensor>& tensors,
                               uint64_t max_file_bytes, bool is_state) {
  std::vector<Output> outputs(1);
  uint64_t bytes = 0;
  for (const SafetensorsTensor& t : tensors) {
    uint64_t tensor_bytes = DTypeSize(t.dtype);
    for (int64_t dim : t.shape) tensor_bytes *= static_cast<uint64_t>(dim);
    if (!outputs.back().tensors.empty() && bytes + tensor_bytes > max_file_bytes) {
      outputs.emplace_back();
      bytes = 0;
    }
    outputs.back().tensors.push_back(t);
    bytes += tensor_bytes;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    outputs[i].is_state = is_state;
    outputs[i].file = outputs.size() == 1 ? prefix + ".safetensors"
                                          : absl::StrFormat("%s-%05d-of-%05d.safetensors", prefix, i + 1, outputs.size());
  }
  return outputs;
}

// model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": {name: file}}.
std::string IndexJson(const std::vector<Output>& outputs) {
  Json weight_map = Json::object();
  uint64_t total = 0;
  for (const Output& output : outputs) {
    for (const SafetensorsTensor& t : output.tensors) {
      weight_map[t.name] = output.file;
      uint64_t tensor_bytes = DTypeSize(t.dtype);
      for (int64_t dim : t.shape) tensor_bytes *= static_cast<uint64_t>(dim);
      total += tensor_bytes;
    }
  }
  return Json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2);
}

absl::Status WriteFull(CheckpointSink& sink, int rank, const std::vector<SavedShard>& shards,
                       bool optimizer, uint64_t max_file_bytes, ProgressCounter* progress,
                       std::vector<std::string>& files) {
  std::vector<SafetensorsTensor> model, state;
  std::set<std::string> fqns;
  for (const SavedShard& shard : shards) {
    for (const TensorSpec& t : shard.group->layout().tensors()) {
      if (!fqns.insert(t.fqn).second) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor name '", t.fqn, "' appears in two groups; a FULL checkpoint needs unique names"));
      }
      model.push_back({t.fqn, t.dtype, t.shape});
      if (!optimizer) continue;
      for (const auto& [name, values] : shard.snapshot.state) {
        state.push_back({absl::StrCat(t.fqn, ".", name), DType::kFloat32, t.shape});
      }
    }
  }
  std::vector<Output> outputs = SplitFiles("model", model, max_file_bytes, false);
  std::vector<Output> state_outputs;
  if (optimizer) state_outputs = SplitFiles("optimizer", state, max_file_bytes, true);
  for (const std::vector<Output>* split : {&outputs, &state_outputs}) {
    if (split->size() <= 1 || rank != 0) continue;
    const std::string index_file = absl::StrCat(split == &outputs ? "model" : "optimizer", ".safetensors.index.json");
    const std::string index = IndexJson(*split);
    FLATSHARD_RETURN_IF_ERROR(sink.Open(index_file, index.size(), /*exclusive=*/true));
    FLATSHARD_RETURN_IF_ERROR(
        sink.Write(index_file, 0, absl::MakeConstSpan(reinterpret_cast<const std::byte*>(index.data()), index.size())));
    FLATSHARD_RETURN_IF_ERROR(sink.Close(index_file));
    files.push_back(index_file);
  }
  outputs.insert(outputs.end(), state_outputs.begin(), state_outputs.end());
  // The optimizer file says, per group, which optimizer, how many steps and with what
  // hyper-parameters (strings, as safetensors metadata must be).
  std::map<std::string, std::string> optimizer_metadata = {{"format", "pt"}};
  for (const SavedShard& shard : shards) {
    const std::string& group = shard.group->name();
    optimizer_metadata[group + ".optimizer"] = shard.group->optimizer_name();
    optimizer_metadata[group + ".step"] = std::to_string(shard.snapshot.optimizer_steps);
    // What an import of the files needs to make them a checkpoint as this one is.
    optimizer_metadata[group + ".version"] = std::to_string(shard.snapshot.version);
    optimizer_metadata[group + ".momentum_initialized"] = shard.snapshot.momentum_initialized ? "true" : "false";
    optimizer_metadata[group + ".hyperparams"] = OptimizerHyperparamsJson(shard.group->optimizer_config());
    std::string fqns;
    for (const TensorSpec& t : shard.group->layout().tensors()) absl::StrAppend(&fqns, fqns.empty() ? "" : ",", t.fqn);
    optimizer_metadata[group + ".params"] = fqns;
  }
  for (Output& output : outputs) {
    FLATSHARD_ASSIGN_OR_RETURN(
        SafetensorsHeader header,
        SafetensorsHeader::Build(output.tensors, output.is_state ? optimizer_metadata
                                                                 : std::map<std::string, std::string>{{"format", "pt"}}));
    FLATSHARD_RETURN_IF_ERROR(sink.Open(output.file, header.file_size(), /*exclusive=*/false));
    if (rank == 0) FLATSHARD_RETURN_IF_ERROR(sink.Write(output.file, 0, header.bytes()));
    for (const SavedShard& shard : shards) {
      std::vector<FullArray> arrays;
      if (!output.is_state) {
        arrays.push_back({"", ""});
      } else {
        for (const auto& [name, values] : shard.snapshot.state) arrays.push_back({name, "." + name});
      }
      FLATSHARD_RETURN_IF_ERROR(WritePieces(sink, output.file, header, shard, arrays, progress));
    }
    FLATSHARD_RETURN_IF_ERROR(sink.Close(output.file));
    files.push_back(output.file);
  }
  return absl::OkStatus();
}

std::string PieceName(const std::string& group, const std::string& fqn, int64_t intra_start) {
  return absl::StrCat(group, "/", fqn, "@", intra_start);
}

// The groups' specs, as the manifest lists them.
Json GroupSpecs(const std::vector<SavedShard>& shards, bool optimizer) {
  Json specs = Json::array();
  for (const SavedShard& shard : shards) specs.push_back(GroupJson(*shard.group, shard.snapshot, optimizer));
  return specs;
}

// SHARDED and LOCAL: one file per server, written by it alone, fp32. With
// `describe_groups`, SHARDED's shard 0 carries what a manifest would say of the files
// (kShardedDescriptionKey).
absl::Status WriteOwnFile(CheckpointSink& sink, int rank, CheckpointKind kind,
                          const std::vector<SavedShard>& shards, bool optimizer, bool describe_groups,
                          ProgressCounter* progress, std::vector<std::string>& files) {
  struct Item {
    std::string name;
    const SavedShard* shard;
    std::string state;  // empty: parameters
    int64_t offset;     // in the shard
    int64_t count;
  };
  std::vector<Item> items;
  for (const SavedShard& shard : shards) {
    const std::string& group = shard.group->name();
    std::vector<std::string> states = {""};
    if (optimizer) {
      for (const auto& [name, values] : shard.snapshot.state) states.push_back(name);
    }
    for (const std::string& state : states) {
      const std::string suffix = state.empty() ? "" : "." + state;
      if (kind == CheckpointKind::kLocal) {
        items.push_back({absl::StrCat(group, suffix.empty() ? ".params" : suffix), &shard, state, 0,
                         shard.group->shard_numel()});
        continue;
      }
      for (const TensorPiece& piece : shard.pieces) {
        items.push_back({PieceName(group, shard.group->layout().tensor(piece.tensor_index).fqn, piece.intra_start) + suffix,
                         &shard, state, piece.flat_offset - shard.start, piece.numel});
      }
    }
  }
  std::vector<SafetensorsTensor> tensors;
  for (const Item& item : items) tensors.push_back({item.name, DType::kFloat32, {item.count}});
  std::map<std::string, std::string> metadata;
  if (describe_groups && kind == CheckpointKind::kSharded && rank == 0) {
    metadata[kShardedDescriptionKey] = Json{{"shards", shards.front().group->layout().num_shards()},
                                            {"optimizer", optimizer},
                                            {"groups", GroupSpecs(shards, optimizer)}}
                                           .dump();
  }
  FLATSHARD_ASSIGN_OR_RETURN(SafetensorsHeader header, SafetensorsHeader::Build(tensors, metadata));
  const std::string name =
      kind == CheckpointKind::kLocal ? absl::StrCat("local-", rank, ".safetensors") : ShardFileName(rank);
  FLATSHARD_RETURN_IF_ERROR(sink.Open(name, header.file_size(), /*exclusive=*/true));
  FLATSHARD_RETURN_IF_ERROR(sink.Write(name, 0, header.bytes()));
  std::vector<float> slice;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    for (int64_t done = 0; done < item.count; done += kSliceElements) {
      slice.resize(static_cast<size_t>(std::min(kSliceElements, item.count - done)));
      FLATSHARD_RETURN_IF_ERROR(item.shard->Read(item.state, item.offset + done, static_cast<int64_t>(slice.size()), slice.data()));
      FLATSHARD_RETURN_IF_ERROR(WriteTensorBytes(
          sink, name, header.data_start() + header.tensors()[i].begin + static_cast<uint64_t>(done) * sizeof(float),
          Bytes(absl::MakeConstSpan(slice)), progress));
    }
  }
  FLATSHARD_RETURN_IF_ERROR(sink.Close(name));
  files.push_back(name);
  return absl::OkStatus();
}

// Holds a group at one version (Group::HoldAt) while it lives.
class HoldGuard {
 public:
  HoldGuard(std::shared_ptr<Group> group, int64_t version) : group_(std::move(group)), version_(version) {
    group_->HoldAt(version_);
  }
  HoldGuard(const HoldGuard&) = delete;
  HoldGuard& operator=(const HoldGuard&) = delete;
  ~HoldGuard() { group_->ReleaseHold(version_); }

 private:
  std::shared_ptr<Group> group_;
  const int64_t version_;
};

}  // namespace

nlohmann::json TensorsJson(const FlatLayout& layout) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorSpec& t : layout.tensors()) {
    tensors.push_back({{"name", t.fqn}, {"shape", t.shape}, {"dtype", DTypeName(t.dtype)}});
  }
  return tensors;
}

absl::Status SavedShard::Read(absl::string_view state, int64_t offset, int64_t count, float* out) const {
  if (pin != nullptr) return group->ReadPinned(state, offset, count, out);
  const HostFloats* values = &snapshot.params;
  for (const auto& [name, buffer] : snapshot.state) {
    if (name == state) values = &buffer;
  }
  std::copy_n(values->data() + offset, count, out);
  return absl::OkStatus();
}

// This server's shard of every group of `job` at `versions`: snapshots, or with `pin`
// the live groups held at those versions (released when the Shards are destroyed).
absl::StatusOr<std::vector<SavedShard>> TakeShards(const Registry& registry, int rank, const std::string& job,
                                              const std::map<std::string, int64_t>& versions,
                                              absl::Time deadline, bool pin) {
  const std::vector<std::shared_ptr<Group>> groups = registry.job_groups(job);
  if (groups.empty()) return absl::FailedPreconditionError(absl::StrCat("job '", job, "' has no groups"));
  for (const auto& group : groups) {
    if (!versions.contains(group->name())) {
      return absl::InvalidArgumentError(absl::StrCat("no version given for group '", group->name(), "'"));
    }
  }
  // The groups cut at the cut's highest version are held there before any is pinned:
  // while a pin waits for one of them to reach it, the others reach it and must not step
  // past it. A group cut lower (a cut inside a step of groups that step apart) is not:
  // its step may be what the others wait for (the worker's connection that carries it,
  // a clipped job's steps, which run group after group), and a later cut follows instead.
  std::vector<std::unique_ptr<HoldGuard>> holds;
  if (pin) {
    int64_t highest = 0;
    for (const auto& group : groups) highest = std::max(highest, versions.at(group->name()));
    for (const auto& group : groups) {
      if (versions.at(group->name()) == highest) holds.push_back(std::make_unique<HoldGuard>(group, highest));
    }
  }
  std::vector<SavedShard> shards;
  for (const auto& group : groups) {
    const auto version = versions.find(group->name());
    absl::StatusOr<ShardSnapshot> snapshot =
        pin ? group->Pin(version->second, deadline) : group->Snapshot(version->second, deadline);
    if (!snapshot.ok() && group->version() > version->second) {
      return absl::AbortedError(absl::StrCat("group '", group->name(), "' is at version ", group->version(),
                                             ", past the cut's ", version->second, " (training overtook the cut)"));
    }
    FLATSHARD_RETURN_IF_ERROR(snapshot.status());
    const FlatLayout& layout = group->layout();
    shards.push_back({group, *std::move(snapshot), layout.shard_start(rank),
                      layout.MapRange(layout.shard_start(rank), layout.shard_end(rank)),
                      pin ? std::make_unique<PinGuard>(group) : nullptr});
  }
  return shards;
}

// The tensor bytes a server's part of a save writes (headers, a few KiB, aside), for
// the progress total.
uint64_t PartBytes(CheckpointKind kind, bool optimizer, const std::vector<SavedShard>& shards) {
  uint64_t bytes = 0;
  for (const SavedShard& shard : shards) {
    const uint64_t states = optimizer ? shard.snapshot.state.size() : 0;
    if (kind == CheckpointKind::kLocal) {
      bytes += static_cast<uint64_t>(shard.group->shard_numel()) * sizeof(float) * (1 + states);
      continue;
    }
    for (const TensorPiece& piece : shard.pieces) {
      const DType dtype = kind == CheckpointKind::kFull ? shard.group->layout().tensor(piece.tensor_index).dtype
                                                        : DType::kFloat32;
      bytes += static_cast<uint64_t>(piece.numel) * (DTypeSize(dtype) + sizeof(float) * states);
    }
  }
  return bytes;
}

// Writes the snapshots' files into `sink`; returns their names and (if asked) the groups'
// JSON specs for the manifest.
absl::StatusOr<std::vector<std::string>> WriteShards(CheckpointSink& sink, int rank, CheckpointKind kind,
                                                     bool optimizer, uint64_t max_file_bytes,
                                                     const std::vector<SavedShard>& shards, Json* group_specs,
                                                     ProgressCounter* progress) {
  std::vector<std::string> files;
  if (kind == CheckpointKind::kFull) {
    FLATSHARD_RETURN_IF_ERROR(WriteFull(sink, rank, shards, optimizer, max_file_bytes, progress, files));
  } else {
    // A save's manifest describes the groups; an export's shard 0 must.
    FLATSHARD_RETURN_IF_ERROR(
        WriteOwnFile(sink, rank, kind, shards, optimizer, /*describe_groups=*/group_specs == nullptr, progress, files));
  }
  if (group_specs != nullptr) *group_specs = GroupSpecs(shards, optimizer);
  return files;
}

}  // namespace flatshard::server
