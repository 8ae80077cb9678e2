#include "server/checkpoint_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <iostream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/file.h"
#include "core/huge_pages.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"
#include "server/checkpoint_reader.h"
#include "server/checkpoint_sink.h"
#include "server/file_extents.h"

namespace flatshard::server {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr char kFormat[] = "flatshard-checkpoint/2";  // /2: extent checksums
constexpr char kManifest[] = "manifest.json";

// Checkpoint names, and the names of their files: one path component.
absl::Status ValidateName(const std::string& name, absl::string_view what = "checkpoint name") {
  const bool ok = !name.empty() && name.size() <= 128 && name[0] != '.' &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
                  });
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", name, "': use 1-128 characters of [A-Za-z0-9._-], not starting with "
        "'.' (names are confined to the server's --checkpoint_root)"));
  }
  return absl::OkStatus();
}

bool IsSymlink(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

absl::Span<const std::byte> Bytes(const std::vector<std::byte>& v) { return absl::MakeConstSpan(v); }
absl::Span<const std::byte> Bytes(absl::Span<const float> v) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float));
}

Json TensorsJson(const FlatLayout& layout) {
  Json tensors = Json::array();
  for (const TensorSpec& t : layout.tensors()) {
    tensors.push_back({{"name", t.fqn}, {"shape", t.shape}, {"dtype", DTypeName(t.dtype)}});
  }
  return tensors;
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

// Unpins a group when a save or export is done with it. Not copyable: exactly one Unpin
// per Pin.
class PinGuard {
 public:
  explicit PinGuard(std::shared_ptr<Group> group) : group_(std::move(group)) {}
  PinGuard(const PinGuard&) = delete;
  PinGuard& operator=(const PinGuard&) = delete;
  ~PinGuard() { group_->Unpin(); }

 private:
  std::shared_ptr<Group> group_;
};

// One server's shard of one group at one version: a snapshot (saves: the copy lets
// training go on while the bytes are written) or the live group pinned at that version
// (exports: nothing is copied; the group's next optimizer step waits for the export).
struct Shard {
  std::shared_ptr<Group> group;
  ShardSnapshot snapshot;  // values empty when pinned (metadata and state names only)
  int64_t start = 0;       // shard_start(rank)
  std::vector<TensorPiece> pieces;
  std::unique_ptr<PinGuard> pin;

  // `count` elements of the parameters (`state` empty) or of optimizer state `state`,
  // from element `offset` of the shard.
  absl::Status Read(absl::string_view state, int64_t offset, int64_t count, float* out) const {
    if (pin != nullptr) return group->ReadPinned(state, offset, count, out);
    const HostFloats* values = &snapshot.params;
    for (const auto& [name, buffer] : snapshot.state) {
      if (name == state) values = &buffer;
    }
    std::copy_n(values->data() + offset, count, out);
    return absl::OkStatus();
  }
};

// Elements converted and written at a time: bounds the memory of a save or export.
constexpr int64_t kSliceElements = int64_t{1} << 20;

absl::Status WritePieces(CheckpointSink& sink, const std::string& file, const SafetensorsHeader& header,
                         const Shard& shard, absl::string_view state, const std::string& tensor_suffix) {
  const FlatLayout& layout = shard.group->layout();
  std::vector<float> values;
  std::vector<std::byte> converted;
  for (const TensorPiece& piece : shard.pieces) {
    const TensorSpec& spec = layout.tensor(piece.tensor_index);
    const SafetensorsTensor* entry = header.Find(spec.fqn + tensor_suffix);
    if (entry == nullptr) continue;  // in another file of a split FULL checkpoint
    const size_t element = DTypeSize(entry->dtype);
    for (int64_t done = 0; done < piece.numel; done += kSliceElements) {
      const int64_t count = std::min(kSliceElements, piece.numel - done);
      values.resize(static_cast<size_t>(count));
      FLATSHARD_RETURN_IF_ERROR(shard.Read(state, piece.flat_offset - shard.start + done, count, values.data()));
      converted.resize(static_cast<size_t>(count) * element);
      FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Cast(DType::kFloat32, values.data(), entry->dtype, converted.data(), count));
      FLATSHARD_RETURN_IF_ERROR(sink.Write(
          file, header.data_start() + entry->begin + static_cast<uint64_t>(piece.intra_start + done) * element,
          Bytes(converted)));
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

absl::Status WriteFull(CheckpointSink& sink, int rank, const std::vector<Shard>& shards,
                       bool optimizer, uint64_t max_file_bytes, std::vector<std::string>& files) {
  std::vector<SafetensorsTensor> model, state;
  std::set<std::string> fqns;
  for (const Shard& shard : shards) {
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
  for (const Shard& shard : shards) {
    const std::string& group = shard.group->name();
    optimizer_metadata[group + ".optimizer"] = shard.group->optimizer_name();
    optimizer_metadata[group + ".step"] = std::to_string(shard.snapshot.optimizer_steps);
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
    for (const Shard& shard : shards) {
      if (!output.is_state) {
        FLATSHARD_RETURN_IF_ERROR(WritePieces(sink, output.file, header, shard, "", ""));
        continue;
      }
      for (const auto& [name, values] : shard.snapshot.state) {
        FLATSHARD_RETURN_IF_ERROR(WritePieces(sink, output.file, header, shard, name, "." + name));
      }
    }
    FLATSHARD_RETURN_IF_ERROR(sink.Close(output.file));
    files.push_back(output.file);
  }
  return absl::OkStatus();
}

std::string PieceName(const std::string& group, const std::string& fqn, int64_t intra_start) {
  return absl::StrCat(group, "/", fqn, "@", intra_start);
}

// SHARDED and LOCAL: one file per server, written by it alone, fp32.
absl::Status WriteOwnFile(CheckpointSink& sink, int rank, CheckpointKind kind,
                          const std::vector<Shard>& shards, bool optimizer,
                          std::vector<std::string>& files) {
  struct Item {
    std::string name;
    const Shard* shard;
    std::string state;  // empty: parameters
    int64_t offset;     // in the shard
    int64_t count;
  };
  std::vector<Item> items;
  for (const Shard& shard : shards) {
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
  FLATSHARD_ASSIGN_OR_RETURN(SafetensorsHeader header, SafetensorsHeader::Build(tensors, {}));
  const std::string name = absl::StrCat(kind == CheckpointKind::kLocal ? "local-" : "shard-", rank, ".safetensors");
  FLATSHARD_RETURN_IF_ERROR(sink.Open(name, header.file_size(), /*exclusive=*/true));
  FLATSHARD_RETURN_IF_ERROR(sink.Write(name, 0, header.bytes()));
  std::vector<float> slice;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    for (int64_t done = 0; done < item.count; done += kSliceElements) {
      slice.resize(static_cast<size_t>(std::min(kSliceElements, item.count - done)));
      FLATSHARD_RETURN_IF_ERROR(item.shard->Read(item.state, item.offset + done, static_cast<int64_t>(slice.size()), slice.data()));
      FLATSHARD_RETURN_IF_ERROR(sink.Write(
          name, header.data_start() + header.tensors()[i].begin + static_cast<uint64_t>(done) * sizeof(float),
          Bytes(absl::MakeConstSpan(slice))));
    }
  }
  FLATSHARD_RETURN_IF_ERROR(sink.Close(name));
  files.push_back(name);
  return absl::OkStatus();
}

absl::StatusOr<Json> ReadJson(const std::string& path) {
  FLATSHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& error) {
    return absl::DataLossError(absl::StrCat("'", path, "' is not valid JSON: ", error.what()));
  }
}

// This server's shard of every group of `job` at `versions`: snapshots, or with `pin`
// the live groups held at those versions (released when the Shards are destroyed).
absl::StatusOr<std::vector<Shard>> TakeShards(const Registry& registry, int rank, const std::string& job,
                                              const std::map<std::string, int64_t>& versions,
                                              absl::Time deadline, bool pin) {
  const std::vector<std::shared_ptr<Group>> groups = registry.job_groups(job);
  if (groups.empty()) return absl::FailedPreconditionError(absl::StrCat("job '", job, "' has no groups"));
  std::vector<Shard> shards;
  for (const auto& group : groups) {
    const auto version = versions.find(group->name());
    if (version == versions.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no version given for group '", group->name(), "'"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(ShardSnapshot snapshot, pin ? group->Pin(version->second, deadline)
                                                           : group->Snapshot(version->second, deadline));
    const FlatLayout& layout = group->layout();
    shards.push_back({group, std::move(snapshot), layout.shard_start(rank),
                      layout.MapRange(layout.shard_start(rank), layout.shard_end(rank)),
                      pin ? std::make_unique<PinGuard>(group) : nullptr});
  }
  return shards;
}

// The tensor bytes a server's part of a save writes (headers, a few KiB, aside), for
// the progress total.
uint64_t PartBytes(CheckpointKind kind, bool optimizer, const std::vector<Shard>& shards) {
  uint64_t bytes = 0;
  for (const Shard& shard : shards) {
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
                                                     const std::vector<Shard>& shards, std::string* group_specs) {
  std::vector<std::string> files;
  if (kind == CheckpointKind::kFull) {
    FLATSHARD_RETURN_IF_ERROR(WriteFull(sink, rank, shards, optimizer, max_file_bytes, files));
  } else {
    FLATSHARD_RETURN_IF_ERROR(WriteOwnFile(sink, rank, kind, shards, optimizer, files));
  }
  if (group_specs != nullptr) {
    Json specs = Json::array();
    for (const Shard& shard : shards) specs.push_back(GroupJson(*shard.group, shard.snapshot, optimizer));
    *group_specs = specs.dump();
  }
  return files;
}

}  // namespace

absl::string_view CheckpointKindName(CheckpointKind kind) {
  switch (kind) {
    case CheckpointKind::kFull:
      return "full";
    case CheckpointKind::kSharded:
      return "sharded";
    case CheckpointKind::kLocal:
      return "local";
  }
  return "?";
}

absl::StatusOr<CheckpointKind> ParseCheckpointKind(absl::string_view name) {
  if (name == "full") return CheckpointKind::kFull;
  if (name == "sharded") return CheckpointKind::kSharded;
  if (name == "local") return CheckpointKind::kLocal;
  return absl::InvalidArgumentError(absl::StrCat("checkpoint kind '", name, "': expected full, sharded or local"));
}

CheckpointStore::CheckpointStore(Registry& registry, int rank, int num_servers, std::string root,
                                 uint64_t max_file_bytes, PeerClient* peers)
    : registry_(registry),
      rank_(rank),
      num_servers_(num_servers),
      root_(std::move(root)),
      max_file_bytes_(max_file_bytes),
      peers_(peers) {}

absl::StatusOr<std::string> CheckpointStore::CheckpointDir(const std::string& name) const {
  if (root_.empty()) {
    return absl::FailedPreconditionError("this server has no --checkpoint_root; checkpoints are disabled");
  }
  FLATSHARD_RETURN_IF_ERROR(ValidateName(name));
  return root_ + "/" + name;
}

absl::Status CheckpointStore::Export(CheckpointSink& sink, CheckpointKind kind, bool optimizer,
                                     const std::string& job, const std::map<std::string, int64_t>& versions,
                                     absl::Time deadline) const {
  // Pinned, not copied: the server's memory stays bounded by the slices in flight.
  FLATSHARD_ASSIGN_OR_RETURN(std::vector<Shard> shards,
                             TakeShards(registry_, rank_, job, versions, deadline, /*pin=*/true));
  return WriteShards(sink, rank_, kind, optimizer, max_file_bytes_, shards, nullptr).status();
}

absl::StatusOr<std::string> CheckpointStore::RootId() {
  if (root_.empty()) return std::string();
  absl::MutexLock lock(&mu_);
  if (!root_id_.empty()) return root_id_;
  const std::string path = root_ + "/.flatshard-root-id";
  if (!fs::exists(path)) {
    // Written aside and linked into place: link() fails if another server won the race,
    // and nobody ever reads a half-written id.
    std::random_device random;
    const std::string id = absl::StrFormat("%08x%08x%08x%08x", random(), random(), random(), random());
    const std::string temporary = absl::StrCat(path, ".", id);
    FLATSHARD_RETURN_IF_ERROR(WriteFileAtomically(temporary, id));
    const int linked = link(temporary.c_str(), path.c_str());
    const int err = errno;
    std::remove(temporary.c_str());
    if (linked != 0 && err != EEXIST) {
      return absl::InternalError(absl::StrCat("cannot create '", path, "': ", std::strerror(err)));
    }
  }
  FLATSHARD_ASSIGN_OR_RETURN(root_id_, ReadFileToString(path));
  return root_id_;
}

absl::StatusOr<bool> CheckpointStore::KeptByServerZero(const std::string& home_root_id) {
  if (home_root_id.empty()) return false;
  FLATSHARD_ASSIGN_OR_RETURN(const std::string own_id, RootId());
  if (own_id == home_root_id) return false;
  if (rank_ == 0) {
    return absl::FailedPreconditionError(absl::StrCat("this server (rank 0) has checkpoint root id '", own_id,
                                                      "', not '", home_root_id, "'"));
  }
  if (peers_ == nullptr) {
    return absl::FailedPreconditionError("this server cannot reach server 0's checkpoint root (no peers)");
  }
  return true;
}

absl::Status CheckpointStore::Save(const std::string& name, CheckpointKind kind, bool optimizer,
                                   const std::string& job,
                                   const std::map<std::string, int64_t>& versions,
                                   absl::Time deadline, const SaveOptions& options) {
  FLATSHARD_RETURN_IF_ERROR(ValidateName(name));
  bool to_server_zero = false;
  if (kind != CheckpointKind::kLocal) {
    FLATSHARD_ASSIGN_OR_RETURN(to_server_zero, KeptByServerZero(options.home_root_id));
  }
  std::string dir;
  if (!to_server_zero) {
    FLATSHARD_ASSIGN_OR_RETURN(const std::string final_dir, CheckpointDir(name));
    if (fs::exists(final_dir) || IsSymlink(final_dir)) {
      return absl::AlreadyExistsError(absl::StrCat("checkpoint '", name, "' already exists; delete it first"));
    }
    dir = PartialDir(name);
    std::error_code error;
    fs::create_directories(dir, error);
    if (error || IsSymlink(dir)) {
      return absl::InternalError(absl::StrCat("cannot create '", dir, "': ", error.message()));
    }
  }
  // Asynchronous: snapshots, so that training goes on while the bytes are written.
  // Blocking: the live groups, pinned at the cut's version, as an export has them: no
  // copy (and no second copy of the shards in memory); their next optimizer step waits.
  FLATSHARD_ASSIGN_OR_RETURN(std::vector<Shard> shards,
                             TakeShards(registry_, rank_, job, versions, deadline, /*pin=*/!options.async));
  // What the part says besides its extents (which the writing sink records).
  auto describe = [this, job, kind, optimizer](const std::vector<std::string>& files, const std::string& specs) {
    return Json{{"job", job},           {"kind", CheckpointKindName(kind)}, {"servers", num_servers_},
                {"optimizer", optimizer}, {"groups", Json::parse(specs)},   {"files", files}};
  };
  const bool async = options.async;
  std::shared_ptr<ProgressCounter> progress = progress_.Start(name, "save");
  progress->total = PartBytes(kind, optimizer, shards);
  auto write = [this, name, kind, optimizer, dir, to_server_zero, async, describe, progress,
                deadline = async ? absl::InfiniteFuture() : deadline,
                shards = std::move(shards)]() -> absl::Status {
    std::string group_specs;
    if (to_server_zero) {
      FLATSHARD_ASSIGN_OR_RETURN(const std::unique_ptr<PeerPartWriter> sink,
                                 peers_->WritePart(0, name, async, deadline));
      CountingSink counting(*sink, *progress);
      FLATSHARD_ASSIGN_OR_RETURN(std::vector<std::string> files,
                                 WriteShards(counting, rank_, kind, optimizer, max_file_bytes_, shards, &group_specs));
      return sink->Finish(describe(files, group_specs).dump());
    }
    DirectorySink sink(dir);
    CountingSink counting(sink, *progress);
    FLATSHARD_ASSIGN_OR_RETURN(std::vector<std::string> files,
                               WriteShards(counting, rank_, kind, optimizer, max_file_bytes_, shards, &group_specs));
    return FinishPart(name, rank_, sink, describe(files, group_specs).dump(), /*async=*/false);
  };
  if (!async) return write();
  // The snapshot is taken; training goes on while the bytes are written. The last server
  // to finish its part commits (server 0, for parts streamed to it); with a root per
  // server, each server commits its own LOCAL part.
  absl::MutexLock lock(&mu_);
  background_.emplace_back([this, name, to_server_zero, root_per_server = options.root_per_server,
                            write = std::move(write)]() {
    absl::Status status = write();
    if (status.ok() && root_per_server) {
      status = Commit(name);
    } else if (status.ok() && !to_server_zero) {
      status = CommitIfComplete(name);
    }
    if (!status.ok()) {
      std::cerr << "flatshard-server rank " << rank_ << ": async save of checkpoint '" << name
                << "' failed: " << status << std::endl;
    }
  });
  return absl::OkStatus();
}

absl::Status CheckpointStore::CommitIfComplete(const std::string& name) {
  const std::string dir = PartialDir(name);
  for (int rank = 0; rank < num_servers_; ++rank) {
    if (!fs::exists(absl::StrCat(dir, "/part-", rank, ".json"))) return absl::OkStatus();  // not yet
  }
  // A lock file picks exactly one committer.
  if (!File::Open(dir + "/commit.lock", File::Mode::kCreateNew).ok()) return absl::OkStatus();
  return Commit(name);
}

absl::StatusOr<std::unique_ptr<DirectorySink>> CheckpointStore::OpenPart(const std::string& name) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string final_dir, CheckpointDir(name));
  if (fs::exists(final_dir) || IsSymlink(final_dir)) {
    return absl::AlreadyExistsError(absl::StrCat("checkpoint '", name, "' already exists; delete it first"));
  }
  const std::string dir = PartialDir(name);
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || IsSymlink(dir)) return absl::InternalError(absl::StrCat("cannot create '", dir, "': ", error.message()));
  return std::make_unique<DirectorySink>(dir);
}

absl::Status CheckpointStore::FinishPart(const std::string& name, int rank, const DirectorySink& sink,
                                         const std::string& part_json, bool async) {
  if (rank < 0 || rank >= num_servers_) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint part of rank ", rank, "; the cluster has ",
                                                   num_servers_, " servers"));
  }
  Json part = Json::parse(part_json, nullptr, /*allow_exceptions=*/false);
  if (!part.is_object() || !part.contains("files") || !part["files"].is_array()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint '", name, "': server ", rank,
                                                   "'s part description is not a JSON object with its files"));
  }
  Json extents = Json::object();
  for (const auto& [file, file_extents] : sink.extents()) extents[file] = ExtentsToJson(file_extents);
  part["rank"] = rank;
  part["extents"] = extents;
  FLATSHARD_RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(PartialDir(name), "/part-", rank, ".json"), part.dump(1)));
  return async ? CommitIfComplete(name) : absl::OkStatus();
}

absl::Status CheckpointStore::ReadFile(const std::string& name, const std::string& file, uint64_t offset,
                                       uint64_t length,
                                       const std::function<absl::Status(absl::Span<const std::byte>)>& emit) const {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string dir, CheckpointDir(name));
  FLATSHARD_RETURN_IF_ERROR(ValidateName(file, "checkpoint file"));
  const std::string path = dir + "/" + file;
  if (IsSymlink(dir) || IsSymlink(path)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is reached through a symlink; refusing"));
  }
  if (!fs::exists(absl::StrCat(dir, "/", kManifest))) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint named '", name, "'"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(File opened, File::Open(path, File::Mode::kRead));
  FLATSHARD_ASSIGN_OR_RETURN(const uint64_t size, opened.Size());
  if (offset > size || (length != 0 && length > size - offset)) {
    return absl::DataLossError(absl::StrCat("'", path, "' has ", size, " bytes; asked for [", offset, ", ",
                                            offset + length, ")"));
  }
  const uint64_t end = length == 0 ? size : offset + length;
  std::vector<std::byte> buffer(static_cast<size_t>(std::min<uint64_t>(end - offset, uint64_t{4} << 20)));
  for (uint64_t at = offset; at < end; at += buffer.size()) {
    const absl::Span<std::byte> piece(buffer.data(), static_cast<size_t>(std::min<uint64_t>(buffer.size(), end - at)));
    FLATSHARD_RETURN_IF_ERROR(opened.ReadAt(at, piece));
    FLATSHARD_RETURN_IF_ERROR(emit(piece));
  }
  return absl::OkStatus();
}

CheckpointStore::~CheckpointStore() {
  std::vector<std::thread> background;
  {
    absl::MutexLock lock(&mu_);
    background.swap(background_);
  }
  for (std::thread& thread : background) thread.join();
}

namespace {

// Writes `manifest` (with the files' sizes and extents: the writers' checksums, which
// must tile each file exactly) into the partial directory last, fsync'd, and commits by
// renaming it to `final_dir`.
absl::Status WriteManifest(const std::string& root, const std::string& dir, const std::string& final_dir,
                           const std::string& name, Json manifest,
                           std::map<std::string, std::vector<FileExtent>> files) {
  Json file_list = Json::array();
  for (auto& [file, extents] : files) {
    FLATSHARD_ASSIGN_OR_RETURN(File opened, File::Open(dir + "/" + file, File::Mode::kRead));
    FLATSHARD_ASSIGN_OR_RETURN(const uint64_t size, opened.Size());
    FLATSHARD_RETURN_IF_ERROR(
        SortAndCheckTiling(extents, size, absl::StrCat("checkpoint '", name, "' file '", file, "'")));
    file_list.push_back({{"path", file}, {"bytes", size}, {"extents", ExtentsToJson(extents)}});
  }
  manifest["format"] = kFormat;
  manifest["name"] = name;
  manifest["files"] = file_list;
  FLATSHARD_RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(dir, "/", kManifest), manifest.dump(1)));
  if (std::rename(dir.c_str(), final_dir.c_str()) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("cannot commit checkpoint '", name, "': ", std::strerror(errno)));
  }
  return SyncDirectory(root);
}

// Adds a part's extents (part["extents"]: file -> list) to `files`.
absl::Status AddPartExtents(const Json& part, const std::string& what,
                            std::map<std::string, std::vector<FileExtent>>& files) {
  if (!part.contains("files") || !part["files"].is_array() || !part.contains("extents") ||
      !part["extents"].is_object()) {
    return absl::DataLossError(absl::StrCat(what, " lacks its file list"));
  }
  for (const auto& file : part["files"]) {
    const std::string path = file.get<std::string>();
    std::vector<FileExtent>& extents = files[path];
    if (!part["extents"].contains(path)) continue;  // written by other servers only
    FLATSHARD_ASSIGN_OR_RETURN(std::vector<FileExtent> more,
                               ExtentsFromJson(part["extents"][path], absl::StrCat(what, " file '", path, "'")));
    extents.insert(extents.end(), more.begin(), more.end());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckpointStore::Commit(const std::string& name) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string final_dir, CheckpointDir(name));
  const std::string dir = PartialDir(name);
  if (!fs::exists(dir) && fs::exists(final_dir + "/" + kManifest)) {
    return absl::OkStatus();  // a server sharing this root committed it
  }
  bool all_parts = true;
  for (int rank = 0; rank < num_servers_; ++rank) {
    all_parts &= fs::exists(absl::StrCat(dir, "/part-", rank, ".json"));
  }
  if (!all_parts) {
    // Each server has a root of its own: a LOCAL checkpoint is committed per server.
    absl::StatusOr<Json> own = ReadJson(absl::StrCat(dir, "/part-", rank_, ".json"));
    if (own.ok() && own->value("kind", "") == "local") {
      std::map<std::string, std::vector<FileExtent>> files;
      FLATSHARD_RETURN_IF_ERROR(AddPartExtents(*own, absl::StrCat("checkpoint '", name, "' part ", rank_), files));
      own->erase("files");
      own->erase("extents");
      (*own)["root"] = "per-server";  // holds only this server's files; loads read no others
      return WriteManifest(root_, dir, final_dir, name, *std::move(own), files);
    }
  }
  Json manifest;
  std::map<std::string, std::vector<FileExtent>> files;
  for (int rank = 0; rank < num_servers_; ++rank) {
    absl::StatusOr<Json> part = ReadJson(absl::StrCat(dir, "/part-", rank, ".json"));
    if (!part.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", name, "': server ", rank, " has not saved its part in this server's root (",
          part.status().message(), ")"));
    }
    FLATSHARD_RETURN_IF_ERROR(AddPartExtents(*part, absl::StrCat("checkpoint '", name, "' part ", rank), files));
    part->erase("rank");
    part->erase("files");
    part->erase("extents");
    if (rank == 0) {
      manifest = *part;
    } else if (*part != manifest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", name, "': server ", rank, "'s part disagrees with server 0's (versions, layouts or settings)"));
    }
  }
  if (manifest.value("kind", "") == "sharded") {
    // One index of where every piece of every tensor lives, so that a loading server
    // reads only this file and the pieces it needs.
    Json pieces = Json::object();
    for (const auto& [file, extents] : files) {
      FLATSHARD_ASSIGN_OR_RETURN(SafetensorsHeader header, SafetensorsHeader::Read(dir + "/" + file));
      for (const SafetensorsTensor& t : header.tensors()) {
        const size_t at = t.name.rfind('@');
        const size_t dot = t.name.find('.', at);
        int64_t start = 0;
        if (at == std::string::npos || !absl::SimpleAtoi(t.name.substr(at + 1, dot - at - 1), &start)) {
          return absl::DataLossError(absl::StrCat("'", dir, "/", file, "' has an unexpected tensor '", t.name, "'"));
        }
        const std::string key = t.name.substr(0, at) + (dot == std::string::npos ? "" : t.name.substr(dot));
        pieces[key].push_back({start, (t.end - t.begin) / sizeof(float), file, header.data_start() + t.begin});
      }
    }
    const std::string index = Json{{"pieces", pieces}}.dump(1);
    FLATSHARD_RETURN_IF_ERROR(WriteFileAtomically(dir + "/index.json", index));
    const absl::Span<const std::byte> index_bytes(reinterpret_cast<const std::byte*>(index.data()), index.size());
    files["index.json"] = {{0, index.size(), Xxh3(index_bytes)}};
  }
  return WriteManifest(root_, dir, final_dir, name, std::move(manifest), files);
}

absl::StatusOr<std::vector<CheckpointInfo>> CheckpointStore::List() const {
  if (root_.empty()) return absl::FailedPreconditionError("this server has no --checkpoint_root");
  std::vector<CheckpointInfo> result;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root_, error)) {
    if (!entry.is_directory() || entry.is_symlink()) continue;
    const std::string base = entry.path().filename().string();
    CheckpointInfo info;
    if (absl::StartsWith(base, ".") && absl::EndsWith(base, ".partial")) {
      info.name = base.substr(1, base.size() - 9);
      result.push_back(info);
      continue;
    }
    absl::StatusOr<Json> manifest = ReadJson(entry.path().string() + "/" + kManifest);
    if (!manifest.ok()) continue;
    info.name = base;
    info.complete = true;
    info.kind = manifest->value("kind", "");
    info.job = manifest->value("job", "");
    info.servers = manifest->value("servers", 0);
    info.optimizer = manifest->value("optimizer", false);
    for (const auto& file : (*manifest)["files"]) info.bytes += file.value("bytes", int64_t{0});
    for (const auto& group : (*manifest)["groups"]) info.versions[group.value("name", "")] = group.value("version", int64_t{0});
    result.push_back(info);
  }
  if (error) return absl::InternalError(absl::StrCat("cannot list '", root_, "': ", error.message()));
  std::sort(result.begin(), result.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return result;
}

absl::Status CheckpointStore::Delete(const std::string& name) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string dir, CheckpointDir(name));
  std::error_code error;
  uintmax_t removed = 0;
  for (const std::string& path : {dir, PartialDir(name)}) {
    if (IsSymlink(path)) return absl::FailedPreconditionError(absl::StrCat("'", path, "' is a symlink; refusing"));
    removed += fs::remove_all(path, error);
    if (error) return absl::InternalError(absl::StrCat("cannot delete '", path, "': ", error.message()));
  }
  if (removed == 0) return absl::NotFoundError(absl::StrCat("no checkpoint named '", name, "'"));
  return absl::OkStatus();
}

absl::Status CheckpointStore::PrepareLoad(const std::string& name, const std::string& job,
                                          const std::string& home_root_id) {
  FLATSHARD_RETURN_IF_ERROR(ValidateName(name));
  // From this root, unless it lacks the checkpoint and server 0's root is another.
  bool from_server_zero = false;
  if (root_.empty() || !fs::exists(absl::StrCat(root_, "/", name, "/", kManifest))) {
    FLATSHARD_ASSIGN_OR_RETURN(from_server_zero, KeptByServerZero(home_root_id));
  }
  std::string dir;
  absl::StatusOr<Json> manifest_or;
  if (from_server_zero) {
    dir = absl::StrCat("server 0 (", peers_->address(0), ") ", name);
    absl::StatusOr<std::string> text = peers_->ReadCheckpointFile(0, name, kManifest);
    if (!text.ok()) {
      manifest_or = text.status();
    } else {
      manifest_or = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (manifest_or->is_discarded()) {
        return absl::DataLossError(absl::StrCat("'", dir, "/", kManifest, "' is not valid JSON"));
      }
    }
  } else {
    FLATSHARD_ASSIGN_OR_RETURN(dir, CheckpointDir(name));
    if (IsSymlink(dir)) return absl::FailedPreconditionError(absl::StrCat("'", dir, "' is a symlink; refusing"));
    manifest_or = ReadJson(absl::StrCat(dir, "/", kManifest));
  }
  if (absl::IsNotFound(manifest_or.status())) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint named '", name, "'"));
  }
  FLATSHARD_RETURN_IF_ERROR(manifest_or.status());
  const Json& manifest = *manifest_or;
  if (manifest.value("format", "") != kFormat) {
    return absl::DataLossError(absl::StrCat("'", dir, "/manifest.json' is not a ", kFormat, " manifest"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(const CheckpointKind kind, ParseCheckpointKind(manifest.value("kind", "")));
  const bool optimizer = manifest.value("optimizer", false);
  if (kind == CheckpointKind::kLocal && manifest.value("servers", 0) != num_servers_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", name, "' is LOCAL from ", manifest.value("servers", 0), " servers; this cluster has ",
        num_servers_, " (save FULL or SHARDED to change the server count)"));
  }
  // A per-server root's manifest lists only this server's own files.
  if (manifest.value("root", "") == "per-server" && manifest.value("rank", -1) != rank_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", name, "' in this server's root holds server ", manifest.value("rank", -1),
        "'s part; this server is rank ", rank_));
  }
  // Every file's size and extents. Each server verifies the extents it reads as it reads
  // them; between them, the servers read every byte of the tensors.
  std::map<std::string, ManifestFile> files;
  if (!manifest.contains("files") || !manifest["files"].is_array()) {
    return absl::DataLossError(absl::StrCat("'", dir, "/manifest.json' lacks its file list"));
  }
  for (const Json& entry : manifest["files"]) {
    const std::string path = entry.value("path", "");
    const std::string what = absl::StrCat("'", dir, "/manifest.json' file '", path, "'");
    ManifestFile file;
    file.bytes = entry.value("bytes", uint64_t{0});
    FLATSHARD_ASSIGN_OR_RETURN(file.extents, ExtentsFromJson(entry.value("extents", Json()), what));
    if (absl::Status tiled = SortAndCheckTiling(file.extents, file.bytes, what); !tiled.ok()) {
      return absl::DataLossError(tiled.message());
    }
    files[path] = std::move(file);
  }
  const bool split_model = files.count("model.safetensors.index.json") > 0;
  const bool split_optimizer = files.count("optimizer.safetensors.index.json") > 0;
  CheckpointReader reader =
      from_server_zero
          ? CheckpointReader(dir, std::move(files), read_buffers_,
                             [this, name](const std::string& file, uint64_t offset, uint64_t length, std::byte* out) {
                               return peers_->ReadCheckpointFile(0, name, file, offset, length, out);
                             })
          : CheckpointReader(dir, std::move(files), read_buffers_);

  // Verified JSON of the checkpoint (indexes), once.
  std::map<std::string, Json> json_files;
  auto read_json = [&](const std::string& file) -> absl::StatusOr<const Json*> {
    if (auto it = json_files.find(file); it != json_files.end()) return &it->second;
    FLATSHARD_ASSIGN_OR_RETURN(const std::string text, reader.ReadWhole(file));
    try {
      return &json_files.emplace(file, Json::parse(text)).first->second;
    } catch (const Json::parse_error& error) {
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

  // SHARDED: where every stored piece lives, from the checkpoint's index.json:
  // "<group>/<fqn>[.<state>]" -> [[first element, numel, file, byte offset], ...].
  struct StoredPiece {
    std::string file;
    int64_t intra_start;
    int64_t numel;
    uint64_t offset;
  };
  std::map<std::string, std::vector<StoredPiece>> stored;
  if (kind == CheckpointKind::kSharded) {
    FLATSHARD_ASSIGN_OR_RETURN(const Json* index, read_json("index.json"));
    try {
      for (const auto& [key, pieces] : index->at("pieces").items()) {
        for (const Json& piece : pieces) {
          stored[key].push_back({piece.at(2).get<std::string>(), piece.at(0).get<int64_t>(),
                                 piece.at(1).get<int64_t>(), piece.at(3).get<uint64_t>()});
        }
      }
    } catch (const Json::exception& error) {
      return absl::DataLossError(absl::StrCat("'", reader.path("index.json"), "' is malformed: ", error.what()));
    }
  }

  std::vector<std::pair<std::shared_ptr<Group>, LoadedShard>> staged;
  std::set<std::string> in_checkpoint;
  for (const Json& spec : manifest["groups"]) {
    const std::string group_name = spec.value("name", "");
    in_checkpoint.insert(group_name);
    absl::StatusOr<std::shared_ptr<Group>> group_or = registry_.FindGroup(job, group_name);
    if (!group_or.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name, "' has group '", group_name,
                                                        "', which is not registered in job '", job, "'"));
    }
    const std::shared_ptr<Group>& group = *group_or;
    const FlatLayout& layout = group->layout();
    if (spec["tensors"] != TensorsJson(layout) || spec.value("align", int64_t{-1}) != layout.align()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", name, "' group '", group_name, "' does not match the registered group: checkpoint ",
          spec["tensors"].dump(), " align ", spec.value("align", int64_t{-1}), "; registered ",
          TensorsJson(layout).dump(), " align ", layout.align()));
    }
    std::vector<std::string> state_names;
    if (optimizer) {
      for (const auto& s : spec["state"]) state_names.push_back(s.get<std::string>());
      if (state_names != group->optimizer_state_names()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint '", name, "' group '", group_name, "' has ", spec.value("optimizer", ""),
            " optimizer state; the registered group uses ", group->optimizer_name()));
      }
    }
    // Host buffers that a host-tier group adopts on commit (Group::Restore).
    LoadedShard loaded;
    loaded.version = spec.value("version", int64_t{0});
    loaded.optimizer_steps = spec.value("optimizer_steps", int64_t{0});
    loaded.momentum_initialized = spec.value("momentum_initialized", false);
    const size_t shard_numel = static_cast<size_t>(layout.shard_numel());
    const std::string what = absl::StrCat("loading group '", group_name, "'");
    FLATSHARD_ASSIGN_OR_RETURN(loaded.params, AllocateHostUnwritten(shard_numel * sizeof(float), what));
    for (const std::string& state : group->optimizer_state_names()) {
      FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer buffer, AllocateHostUnwritten(shard_numel * sizeof(float), what));
      loaded.state.emplace_back(state, std::move(buffer));
    }
    // The buffers are unwritten: the reads fill every tensor element, padding is zeroed here.
    const int64_t start = layout.shard_start(rank_);
    const std::vector<TensorPiece> pieces = layout.MapRange(start, layout.shard_end(rank_));
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
        const std::string file = absl::StrCat("local-", rank_, ".safetensors");
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
  for (const auto& group : registry_.job_groups(job)) {
    if (!in_checkpoint.count(group->name())) {
      return absl::FailedPreconditionError(absl::StrCat("group '", group->name(), "' of job '", job,
                                                        "' is not in checkpoint '", name, "'"));
    }
  }
  const std::shared_ptr<ProgressCounter> progress = progress_.Start(name, "load");
  FLATSHARD_RETURN_IF_ERROR(reader.Run(progress.get()));
  absl::MutexLock lock(&mu_);
  staged_[name] = std::move(staged);
  return absl::OkStatus();
}

absl::Status CheckpointStore::CommitLoad(const std::string& name) {
  std::vector<std::pair<std::shared_ptr<Group>, LoadedShard>> staged;
  {
    absl::MutexLock lock(&mu_);
    const auto it = staged_.find(name);
    if (it == staged_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", name, "' was not prepared for loading here"));
    }
    staged = std::move(it->second);
    staged_.erase(it);
  }
  for (auto& [group, loaded] : staged) FLATSHARD_RETURN_IF_ERROR(group->Restore(std::move(loaded)));
  return absl::OkStatus();
}

void CheckpointStore::AbortLoad(const std::string& name) {
  absl::MutexLock lock(&mu_);
  staged_.erase(name);
}

}  // namespace flatshard::server
