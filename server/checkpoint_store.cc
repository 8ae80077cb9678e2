#include "server/checkpoint_store.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "server/checkpoint_reader.h"
#include "server/checkpoint_sink.h"
#include "server/checkpoint_writer.h"
#include "server/file_extents.h"
#include "server/json_fields.h"
#include "server/sharded_index.h"

namespace flatshard::server {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr char kFormat[] = "flatshard-checkpoint/2";  // /2: extent checksums
constexpr char kManifest[] = "manifest.json";

// Whether `path` exists; false also when it cannot be told (a symlink loop, a directory
// that cannot be searched), where fs::exists would throw.
bool Exists(const std::string& path) {
  std::error_code error;
  return fs::exists(path, error);
}

bool IsSymlink(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

// Why a save or delete of `name` is refused while server `rank` saves it.
std::string BeingSaved(const std::string& name, int rank) {
  return absl::StrCat("checkpoint '", name, "' is being saved (server ", rank,
                      " is still writing or committing its part)");
}

// The keys whose values a summary of a manifest or part leaves out: each file's extents
// and each group's tensors, MBs for a model of many tensors, where only its kind, job,
// save, servers, sizes or versions are wanted (a listing, a commit's checks).
constexpr absl::string_view kBulkKeys[] = {"extents", "tensors"};

// Every part carries the digest of its group specs under this key; the specs themselves
// only server 0's part (for the manifest) and LOCAL parts (with a root per server, each
// is committed alone). Parts agree on their specs iff the digests agree, so a commit
// reads one copy of what is MBs for a model of many groups, whatever the server count.
constexpr char kGroupsDigest[] = "groups_xxh3";

// The digest of `part`'s group specs (as nlohmann writes them: keys sorted, so equal
// specs give equal text); that of "" for a part without any.
std::string GroupsDigest(const Json& part) {
  const std::string specs = part.contains("groups") ? part.at("groups").dump() : "";
  return absl::StrFormat("%016x", Xxh3(absl::MakeConstSpan(reinterpret_cast<const std::byte*>(specs.data()),
                                                          specs.size())));
}

// `path` as JSON; with `skip`, the values of those keys (at any depth) are left out.
absl::StatusOr<Json> ReadJson(const std::string& path, absl::Span<const absl::string_view> skip = {}) {
  FLATSHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  try {
    if (skip.empty()) return Json::parse(text);
    return Json::parse(text, [skip](int, Json::parse_event_t event, Json& parsed) {
      return event != Json::parse_event_t::key ||
             std::find(skip.begin(), skip.end(), parsed.get_ref<const std::string&>()) == skip.end();
    });
  } catch (const Json::exception& error) {  // parse_error, or out_of_range for a number like 1e999
    return absl::DataLossError(absl::StrCat("'", path, "' is not valid JSON: ", error.what()));
  }
}

// Why save `save_id` of `name` cannot commit: another save of the name did meanwhile.
absl::Status CommittedByAnotherSave(const std::string& name, const std::string& save_id) {
  return absl::AlreadyExistsError(absl::StrCat("checkpoint '", name, "' was committed by another save while save '",
                                               save_id, "' was written; delete it first, or save under another name"));
}

}  // namespace

CheckpointStore::CheckpointStore(Registry& registry, int rank, int num_servers, std::string root,
                                 uint64_t max_file_bytes, PeerClient* peers, absl::Duration staged_load_timeout)
    : registry_(registry),
      rank_(rank),
      num_servers_(num_servers),
      root_(std::move(root)),
      max_file_bytes_(max_file_bytes),
      peers_(peers),
      staged_(staged_load_timeout) {}

absl::StatusOr<std::string> CheckpointStore::CheckpointDir(const std::string& name) const {
  if (root_.empty()) {
    return absl::FailedPreconditionError("this server has no --checkpoint_root; checkpoints are disabled");
  }
  FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(name));
  return root_ + "/" + name;
}

absl::StatusOr<PinnedExport> CheckpointStore::PinExport(const std::string& job,
                                                        const std::map<std::string, int64_t>& versions,
                                                        absl::Time deadline) const {
  // Any replica group holds the same shard: the files are those of its shard index.
  FLATSHARD_ASSIGN_OR_RETURN(const Placement placement, registry_.job_placement(job));
  // Pinned, not copied: the server's memory stays bounded by the slices in flight.
  FLATSHARD_ASSIGN_OR_RETURN(std::vector<SavedShard> shards,
                             TakeShards(registry_, placement.shard, job, versions, deadline, /*pin=*/true));
  return PinnedExport{placement.shard, std::move(shards)};
}

absl::Status CheckpointStore::Export(CheckpointSink& sink, CheckpointKind kind, bool optimizer,
                                     const PinnedExport& pinned) const {
  return WriteShards(sink, pinned.shard, kind, optimizer, max_file_bytes_, pinned.shards, nullptr).status();
}

absl::StatusOr<std::string> CheckpointStore::RootId() {
  if (root_.empty()) return std::string();
  absl::MutexLock lock(&mu_);
  if (!root_id_.empty()) return root_id_;
  const std::string path = root_ + "/.flatshard-root-id";
  if (!Exists(path)) {
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

PendingSave::~PendingSave() {
  if (writing_ || dir_.empty()) return;
  std::error_code ignored;
  fs::remove_all(dir_, ignored);
  fs::remove(fs::path(dir_).parent_path(), ignored);  // unless another save of the name is there
}

absl::Status CheckpointStore::Save(const std::string& name, CheckpointKind kind, bool optimizer,
                                   const std::string& job,
                                   const std::map<std::string, int64_t>& versions,
                                   absl::Time deadline, const SaveOptions& options) {
  FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<PendingSave> save, BeginSave(name, kind, optimizer, job, options));
  FLATSHARD_RETURN_IF_ERROR(PinSave(*save, versions, deadline));
  return FinishSave(*save, deadline);
}

absl::StatusOr<std::unique_ptr<PendingSave>> CheckpointStore::BeginSave(const std::string& name, CheckpointKind kind,
                                                                        bool optimizer, const std::string& job,
                                                                        const SaveOptions& options) {
  FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(name));
  if (!options.save_id.empty()) FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(options.save_id, "save id"));
  FLATSHARD_ASSIGN_OR_RETURN(const Placement placement, registry_.job_placement(job));
  if (placement.replica != 0) {
    // Every replica group holds the same shards; the first one writes them (its ranks
    // are its shard indices), so a checkpoint is that of a cluster of S servers.
    return absl::FailedPreconditionError(absl::StrCat(
        "server ", rank_, " is in replica group ", placement.replica, " of job '", job,
        "'; checkpoints are written by replica group 0 (servers 0 to ", placement.shards - 1, ")"));
  }
  std::unique_ptr<PendingSave> save(new PendingSave());
  save->name_ = name;
  save->kind_ = kind;
  save->optimizer_ = optimizer;
  save->job_ = job;
  save->options_ = options;
  save->servers_ = placement.shards;
  if (kind != CheckpointKind::kLocal) {
    FLATSHARD_ASSIGN_OR_RETURN(save->to_server_zero_, KeptByServerZero(options.home_root_id));
  }
  // Held while `save` lives (async: until this server's part is written and, if it is the
  // last, committed).
  FLATSHARD_ASSIGN_OR_RETURN(save->claim_, ClaimName(name));
  if (!save->to_server_zero_) {
    FLATSHARD_ASSIGN_OR_RETURN(save->dir_, CreateSaveDir(name, options.save_id));
  }
  return save;
}

absl::Status CheckpointStore::PinSave(PendingSave& save, const std::map<std::string, int64_t>& versions,
                                      absl::Time deadline) {
  save.shards_.clear();  // the pins of an earlier cut, which the groups must get past
  // Blocking saves write from the live groups, pinned at the cut: no copy (and no second
  // copy of the shards in memory); their next optimizer step waits. Async ones copy them
  // once every server has pinned (FinishSave).
  FLATSHARD_ASSIGN_OR_RETURN(save.shards_, TakeShards(registry_, rank_, save.job_, versions, deadline, /*pin=*/true));
  save.versions_ = versions;
  return absl::OkStatus();
}

std::map<std::string, int64_t> CheckpointStore::JobVersions(const std::string& job) const {
  std::map<std::string, int64_t> versions;
  for (const auto& group : registry_.job_groups(job)) versions[group->name()] = group->version();
  return versions;
}

absl::Status CheckpointStore::FinishSave(PendingSave& save, absl::Time deadline, std::function<bool()> cancelled) {
  if (save.shards_.empty()) return absl::FailedPreconditionError("the save's cut is not pinned");
  const std::string name = save.name_;
  const std::string save_id = save.options_.save_id;
  const bool async = save.options_.async;
  std::vector<SavedShard> shards;
  if (async) {
    // Copies, so that training goes on while the bytes are written: the groups are still
    // pinned at the cut, so the copies are exactly it.
    FLATSHARD_ASSIGN_OR_RETURN(shards, TakeShards(registry_, rank_, save.job_, save.versions_, deadline,
                                                  /*pin=*/false));
    save.shards_.clear();
  } else {
    shards = std::move(save.shards_);  // released once written; the claim stays with `save`
    save.shards_.clear();
  }
  save.writing_ = true;
  // What the part says besides its extents (which the writing sink records).
  auto describe = [job = save.job_, kind = save.kind_, optimizer = save.optimizer_, servers = save.servers_, save_id](
                      const std::vector<std::string>& files, Json specs) {
    return Json{{"job", job},
                {"kind", CheckpointKindName(kind)},
                {"servers", servers},
                {"optimizer", optimizer},
                {"groups", std::move(specs)},
                {"files", files},
                {"save_id", save_id}};
  };
  std::shared_ptr<ProgressCounter> progress = progress_.Start(name, "save");
  progress->total = PartBytes(save.kind_, save.optimizer_, shards);
  if (!async) save.progress_ = progress;
  auto write = [this, name, save_id, kind = save.kind_, optimizer = save.optimizer_, dir = save.dir_,
                to_server_zero = save.to_server_zero_, servers = save.servers_,
                root_per_server = save.options_.root_per_server, async, describe, progress,
                deadline = async ? absl::InfiniteFuture() : deadline,
                cancelled = async ? nullptr : std::move(cancelled), shards = std::move(shards)]() -> absl::Status {
    Json group_specs;
    if (to_server_zero) {
      FLATSHARD_ASSIGN_OR_RETURN(const std::unique_ptr<PeerPartWriter> peer,
                                 peers_->WritePart(0, name, save_id, async, deadline));
      CancellableSink sink(*peer, cancelled);
      FLATSHARD_ASSIGN_OR_RETURN(
          std::vector<std::string> files,
          WriteShards(sink, rank_, kind, optimizer, max_file_bytes_, shards, &group_specs, progress.get()));
      return peer->Finish(describe(files, std::move(group_specs)).dump());
    }
    DirectorySink directory(dir);
    CancellableSink sink(directory, cancelled);
    absl::StatusOr<std::vector<std::string>> files =
        WriteShards(sink, rank_, kind, optimizer, max_file_bytes_, shards, &group_specs, progress.get());
    absl::Status finished = files.status();
    if (files.ok()) {
      finished = RecordPart(name, save_id, rank_, directory, describe(*files, std::move(group_specs)), false);
    }
    finished = UnlessCommittedMeanwhile(name, save_id, finished);
    if (!finished.ok() && !absl::IsAlreadyExists(finished)) {
      AbandonPart(name, save_id, rank_, servers, root_per_server, finished);
    }
    return finished;
  };
  if (!async) return write();
  // The snapshot is taken; training goes on while the bytes are written. The last server
  // to finish its part commits (server 0, for parts streamed to it); with a root per
  // server, each server commits its own LOCAL part.
  absl::MutexLock lock(&mu_);
  ReapFinishedSaves();
  auto finished = std::make_shared<std::atomic<bool>>(false);
  std::thread thread([this, name, servers = save.servers_, to_server_zero = save.to_server_zero_,
                      root_per_server = save.options_.root_per_server, save_id, write = std::move(write),
                      progress = std::move(progress), claim = std::move(save.claim_), finished]() mutable {
    absl::Status status = write();
    if (status.ok() && root_per_server) {
      status = Commit(name, save_id);
    } else if (status.ok() && !to_server_zero) {
      status = CommitIfComplete(name, save_id, servers);
    }
    if (!status.ok()) spdlog::error("async save of checkpoint '{}' failed: {}", name, status.ToString());
    { auto release = std::move(write); }  // the snapshot
    progress.reset();
    claim.reset();  // the name is free: a listing shows the outcome
    finished->store(true);
  });
  background_.push_back({std::move(thread), std::move(finished)});
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const std::string>> CheckpointStore::ClaimName(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (!saving_.insert(name).second) {
    return absl::AlreadyExistsError(absl::StrCat(BeingSaved(name, rank_), "; wait until it completes"));
  }
  return std::shared_ptr<const std::string>(new std::string(name), [this](const std::string* claimed) {
    {
      absl::MutexLock lock(&mu_);
      saving_.erase(*claimed);
    }
    delete claimed;
  });
}

void CheckpointStore::ReapFinishedSaves() {
  for (auto it = background_.begin(); it != background_.end();) {
    if (it->finished->load()) {
      it->thread.join();  // done but for returning: it takes no lock any more
      it = background_.erase(it);
    } else {
      ++it;
    }
  }
}

int CheckpointStore::PartsExpected(const Json& part) const {
  const bool said = part.is_object() && part.contains("servers") && part.at("servers").is_number_integer();
  const int64_t servers = said ? part.at("servers").get<int64_t>() : num_servers_;
  return servers >= 1 && servers <= num_servers_ ? static_cast<int>(servers) : num_servers_;
}

void CheckpointStore::EndWithoutCommit(const PendingSave& save) {
  if (rank_ != 0 && !save.options_.root_per_server) return;  // server 0 commits every part
  AbandonPart(save.name_, save.options_.save_id, rank_, save.servers_, save.options_.root_per_server,
              absl::CancelledError("the client ended the save before its commit"));
}

void CheckpointStore::AbandonPart(const std::string& name, const std::string& save_id, int rank, int servers,
                                  bool root_per_server, const absl::Status& error) {
  if (rank < 0 || rank >= num_servers_) return;  // a peer's bad request: it has no part here
  spdlog::warn("checkpoint '{}': part {} of save {} failed: {}", name, rank, save_id, error.ToString());
  if (root_per_server) return RemoveSave(name, save_id);
  const std::string dir = SaveDir(name, save_id);
  std::error_code ignored;
  if (!fs::is_directory(dir, ignored)) return;                      // committed or removed: nothing of it left here
  fs::remove(absl::StrCat(dir, "/part-", rank, ".json"), ignored);  // a part whose end failed is void
  const Json marker{{"rank", rank}, {"servers", servers}, {"error", error.ToString()}};
  if (!WriteFileAtomically(absl::StrCat(dir, "/failed-", rank, ".json"), marker.dump()).ok()) return;
  RemoveIfAbandoned(name, save_id);
}

void CheckpointStore::RemoveIfAbandoned(const std::string& name, const std::string& save_id) {
  const std::string dir = SaveDir(name, save_id);
  bool abandoned = false;  // a server marked its part failed (asked first: parts are large)
  for (int rank = 0; rank < num_servers_ && !abandoned; ++rank) {
    abandoned = Exists(absl::StrCat(dir, "/failed-", rank, ".json"));
  }
  if (!abandoned) return;
  int parts = 0;  // the most any part or marker says; the cluster's size if none does
  for (int rank = 0; rank < num_servers_; ++rank) {
    for (const char* kind : {"part", "failed"}) {
      absl::StatusOr<Json> found = ReadJson(absl::StrCat(dir, "/", kind, "-", rank, ".json"), kBulkKeys);
      if (!found.ok() || !found->is_object()) continue;
      const Json servers = found->value("servers", Json(0));
      if (servers.is_number_integer()) parts = std::max(parts, servers.get<int>());
    }
  }
  if (parts <= 0 || parts > num_servers_) parts = num_servers_;
  for (int rank = 0; rank < parts; ++rank) {
    if (!Exists(absl::StrCat(dir, "/part-", rank, ".json")) && !Exists(absl::StrCat(dir, "/failed-", rank, ".json"))) {
      return;  // that server is still writing: the last one removes the directory
    }
  }
  RemoveSave(name, save_id);
  spdlog::warn("checkpoint '{}': save {} failed; its files are removed", name, save_id);
}

void CheckpointStore::RemoveSave(const std::string& name, const std::string& save_id) const {
  std::error_code ignored;
  fs::remove_all(SaveDir(name, save_id), ignored);
  fs::remove(PartialDir(name), ignored);  // unless another save of the name is there
}

absl::Status CheckpointStore::CommitIfComplete(const std::string& name, const std::string& save_id, int parts) {
  const std::string dir = SaveDir(name, save_id);
  for (int rank = 0; rank < parts; ++rank) {
    if (!Exists(absl::StrCat(dir, "/part-", rank, ".json"))) return absl::OkStatus();  // not yet
  }
  // A lock file picks exactly one committer of this save.
  if (!File::Open(dir + "/commit.lock", File::Mode::kCreateNew).ok()) return absl::OkStatus();
  return Commit(name, save_id);
}

absl::StatusOr<std::string> CheckpointStore::CreateSaveDir(const std::string& name, const std::string& save_id) const {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string final_dir, CheckpointDir(name));
  if (!save_id.empty()) FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(save_id, "save id"));
  if (Exists(final_dir) || IsSymlink(final_dir)) {
    return absl::AlreadyExistsError(absl::StrCat("checkpoint '", name, "' already exists; delete it first"));
  }
  const std::string dir = SaveDir(name, save_id);
  if (IsSymlink(PartialDir(name))) {
    return absl::FailedPreconditionError(absl::StrCat("'", PartialDir(name), "' is a symlink; refusing"));
  }
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || IsSymlink(dir)) return absl::InternalError(absl::StrCat("cannot create '", dir, "': ", error.message()));
  return dir;
}

absl::StatusOr<std::unique_ptr<DirectorySink>> CheckpointStore::OpenPart(const std::string& name,
                                                                         const std::string& save_id) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string dir, CreateSaveDir(name, save_id));
  return std::make_unique<DirectorySink>(dir);
}

absl::Status CheckpointStore::FinishPart(const std::string& name, const std::string& save_id, int rank,
                                         const DirectorySink& sink, const std::string& part_json, bool async) {
  if (rank < 0 || rank >= num_servers_) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint part of rank ", rank, "; the cluster has ",
                                                   num_servers_, " servers"));
  }
  return RecordPart(name, save_id, rank, sink, Json::parse(part_json, nullptr, /*allow_exceptions=*/false), async);
}

absl::Status CheckpointStore::RecordPart(const std::string& name, const std::string& save_id, int rank,
                                         const DirectorySink& sink, Json part, bool async) {
  if (!part.is_object() || !part.contains("files") || !part["files"].is_array()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint '", name, "': server ", rank,
                                                   "'s part description is not a JSON object with its files"));
  }
  for (const Json& file : part["files"]) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint '", name, "': server ", rank,
                                                     "'s part lists a file that is not a name: ", file.dump()));
    }
    FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(file.get<std::string>(), "checkpoint file"));
  }
  if (part.value("save_id", Json("")) != save_id) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint '", name, "': server ", rank, "'s part names save ",
                                                   part.value("save_id", Json("")).dump(), ", not save '", save_id,
                                                   "' that it was sent for"));
  }
  Json extents = Json::object();
  for (const auto& [file, file_extents] : sink.extents()) extents[file] = ExtentsToJson(file_extents);
  part["rank"] = rank;
  part["extents"] = extents;
  part[kGroupsDigest] = GroupsDigest(part);
  if (rank != 0 && part.value("kind", Json("")) != "local") part.erase("groups");
  FLATSHARD_RETURN_IF_ERROR(
      WriteFileAtomically(absl::StrCat(SaveDir(name, save_id), "/part-", rank, ".json"), part.dump()));
  RemoveIfAbandoned(name, save_id);  // another part failed before this one was done
  return async ? CommitIfComplete(name, save_id, PartsExpected(part)) : absl::OkStatus();
}

absl::Status CheckpointStore::ReadFile(const std::string& name, const std::string& file, uint64_t offset,
                                       uint64_t length,
                                       const std::function<absl::Status(absl::Span<const std::byte>)>& emit) const {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string dir, CheckpointDir(name));
  FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(file, "checkpoint file"));
  const std::string path = dir + "/" + file;
  if (IsSymlink(dir) || IsSymlink(path)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is reached through a symlink; refusing"));
  }
  if (!Exists(absl::StrCat(dir, "/", kManifest))) {
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
  std::vector<AsyncSave> background;
  {
    absl::MutexLock lock(&mu_);
    background.swap(background_);
  }
  for (AsyncSave& save : background) save.thread.join();
}

namespace {

// Writes `manifest` (with the files' sizes and extents: the writers' checksums, which
// must tile each file exactly) into save directory `dir` last, fsync'd, and commits by
// renaming it to `final_dir`. The name's other saves' directories go with their parent:
// those saves can no longer commit (their writers, if any, fail).
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
    const int err = errno;
    if (err == EEXIST || err == ENOTEMPTY) return CommittedByAnotherSave(name, manifest.value("save_id", ""));
    return absl::InternalError(absl::StrCat("cannot commit checkpoint '", name, "': ", std::strerror(err)));
  }
  std::error_code ignored;  // what a failing writer leaves is not listed beside the checkpoint
  fs::remove_all(fs::path(dir).parent_path(), ignored);
  // The parts' descriptions have done their work: the checkpoint is its manifest and files.
  std::vector<fs::path> bookkeeping;
  for (const auto& entry : fs::directory_iterator(final_dir, ignored)) {
    const std::string base = entry.path().filename().string();
    if ((absl::StartsWith(base, "part-") && absl::EndsWith(base, ".json")) || base == "commit.lock") {
      bookkeeping.push_back(entry.path());
    }
  }
  for (const fs::path& path : bookkeeping) fs::remove(path, ignored);
  FLATSHARD_RETURN_IF_ERROR(SyncDirectory(root));
  spdlog::info("checkpoint '{}' committed: {} ({} of job '{}'), files {}", name, final_dir, manifest.value("kind", "?"),
               manifest.value("job", "?"), file_list.size());
  return absl::OkStatus();
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

absl::Status CheckpointStore::Commit(const std::string& name, const std::string& save_id) {
  // The parts' descriptions are read from disk: one of the wrong shape makes nlohmann
  // throw, which is damage like any other.
  absl::Status committed;
  try {
    committed = CommitParts(name, save_id);
  } catch (const Json::exception& error) {
    committed =
        absl::DataLossError(absl::StrCat("checkpoint '", name, "': a part's description is malformed: ", error.what()));
  }
  committed = UnlessCommittedMeanwhile(name, save_id, committed);
  if (absl::IsResourceExhausted(committed)) {
    // No room for what the commit writes (index, manifest): the parts are whole but can
    // never be committed (no commit is tried twice), and they hold the room that is
    // missing. A save that fails to commit for other reasons (a damaged part) stays,
    // listed as incomplete, to be looked at.
    RemoveSave(name, save_id);
  }
  return committed;
}

absl::Status CheckpointStore::UnlessCommittedMeanwhile(const std::string& name, const std::string& save_id,
                                                       const absl::Status& status) const {
  if (status.ok() || absl::IsAlreadyExists(status) || root_.empty()) return status;
  absl::StatusOr<Json> manifest = ReadJson(absl::StrCat(root_, "/", name, "/", kManifest), kBulkKeys);
  if (!manifest.ok() || !manifest->is_object() || manifest->value("save_id", Json("")) == save_id) return status;
  return CommittedByAnotherSave(name, save_id);
}

namespace {

// Writes a SHARDED checkpoint's index.json (`text`) into its directory `dir` and adds its
// extent to `files`, the manifest's list.
absl::Status AddShardedIndex(const std::string& dir, const std::string& text,
                             std::map<std::string, std::vector<FileExtent>>& files) {
  FLATSHARD_RETURN_IF_ERROR(WriteFileAtomically(dir + "/index.json", text));
  const absl::Span<const std::byte> bytes(reinterpret_cast<const std::byte*>(text.data()), text.size());
  files["index.json"] = {{0, text.size(), Xxh3(bytes)}};
  return absl::OkStatus();
}

}  // namespace

PendingImport::~PendingImport() {
  sink_.reset();  // its files closed before they are removed
  if (!committed_ && !dir_.empty()) {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
    fs::remove(fs::path(dir_).parent_path(), ignored);  // unless a save of the name is there
  }
  // The name is free before the status stops listing the import: whoever sees it gone
  // may take the name at once (members would go the other way round).
  claim_.reset();
  progress_.reset();
}

absl::StatusOr<std::unique_ptr<PendingImport>> CheckpointStore::BeginImport(const std::string& name) {
  FLATSHARD_RETURN_IF_ERROR(CheckpointDir(name).status());
  if (rank_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "imports go to server 0, whose root keeps FULL checkpoints; this is server ", rank_));
  }
  std::unique_ptr<PendingImport> import(new PendingImport());
  import->name_ = name;
  std::random_device random;
  import->import_id_ = absl::StrFormat("import-%08x%08x", random(), random());
  FLATSHARD_ASSIGN_OR_RETURN(import->claim_, ClaimName(name));
  FLATSHARD_ASSIGN_OR_RETURN(import->dir_, CreateSaveDir(name, import->import_id_));
  import->sink_ = std::make_unique<DirectorySink>(import->dir_);
  import->progress_ = progress_.Start(name, "import");
  return import;
}

absl::StatusOr<ImportedCheckpoint> CheckpointStore::CommitImport(PendingImport& import, int64_t version,
                                                                 bool weights_only) {
  std::map<std::string, std::vector<FileExtent>> extents = import.sink_->extents();
  std::map<std::string, uint64_t> sizes;
  for (const auto& [file, written] : extents) {
    FLATSHARD_ASSIGN_OR_RETURN(File opened, File::Open(import.dir_ + "/" + file, File::Mode::kRead));
    FLATSHARD_ASSIGN_OR_RETURN(const uint64_t size, opened.Size());
    uint64_t sent = 0;
    for (const FileExtent& extent : written) sent += extent.length;
    if (sent != size) {
      return absl::InvalidArgumentError(
          absl::StrCat("import '", import.name_, "': ", sent, " of the ", size, " bytes of '", file, "' were sent"));
    }
    sizes[file] = size;
  }
  Json groups;
  FLATSHARD_ASSIGN_OR_RETURN(ImportedCheckpoint imported,
                             DescribeImport(import.dir_, sizes, version, weights_only, groups));
  if (imported.kind == CheckpointKind::kSharded) {
    FLATSHARD_RETURN_IF_ERROR(AddShardedIndex(import.dir_, imported.index_json, extents));
  }
  const Json manifest{{"job", ""},
                      {"kind", CheckpointKindName(imported.kind)},
                      {"servers", imported.shards},
                      {"optimizer", imported.optimizer},
                      {"imported", true},
                      {"groups", std::move(groups)},
                      {"save_id", import.import_id_}};
  FLATSHARD_ASSIGN_OR_RETURN(const std::string final_dir, CheckpointDir(import.name_));
  FLATSHARD_RETURN_IF_ERROR(WriteManifest(root_, import.dir_, final_dir, import.name_, manifest, std::move(extents)));
  import.committed_ = true;
  return imported;
}

absl::Status CheckpointStore::CommitParts(const std::string& name, const std::string& save_id) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string final_dir, CheckpointDir(name));
  const std::string dir = SaveDir(name, save_id);
  if (Exists(final_dir)) {
    // Committed: by this save (a server sharing this root, or a retried commit), or by
    // another one, which leaves this save nothing to do but clear its files.
    absl::StatusOr<Json> manifest = ReadJson(absl::StrCat(final_dir, "/", kManifest), kBulkKeys);
    if (manifest.ok() && manifest->is_object() && manifest->value("save_id", Json("")) == save_id) {
      return absl::OkStatus();
    }
    std::error_code ignored;
    fs::remove_all(dir, ignored);
    return CommittedByAnotherSave(name, save_id);
  }
  // This server's part (there when it commits) says how many parts the save has; it is
  // read once and used again below (server 0's holds MBs of group specs).
  absl::StatusOr<Json> own = ReadJson(absl::StrCat(dir, "/part-", rank_, ".json"));
  const int parts = PartsExpected(own.ok() ? *own : Json());
  bool all_parts = true;
  for (int rank = 0; rank < parts; ++rank) {
    all_parts &= Exists(absl::StrCat(dir, "/part-", rank, ".json"));
  }
  if (!all_parts) {
    // Each server has a root of its own: a LOCAL checkpoint is committed per server.
    if (own.ok() && own->value("kind", "") == "local") {
      std::map<std::string, std::vector<FileExtent>> files;
      FLATSHARD_RETURN_IF_ERROR(AddPartExtents(*own, absl::StrCat("checkpoint '", name, "' part ", rank_), files));
      own->erase("files");
      own->erase("extents");
      own->erase(kGroupsDigest);
      (*own)["root"] = "per-server";  // holds only this server's files; loads read no others
      return WriteManifest(root_, dir, final_dir, name, *std::move(own), files);
    }
  }
  Json manifest;
  std::optional<Json> groups;  // server 0's group specs
  std::map<std::string, std::vector<FileExtent>> files;
  for (int rank = 0; rank < parts; ++rank) {
    absl::StatusOr<Json> part =
        rank == rank_ && own.ok() ? std::move(own) : ReadJson(absl::StrCat(dir, "/part-", rank, ".json"));
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
      if (GroupsDigest(*part) != part->value(kGroupsDigest, std::string())) {
        return absl::DataLossError(
            absl::StrCat("checkpoint '", name, "': server 0's part holds group specs that do not match its digest"));
      }
      if (part->contains("groups")) groups = std::move(part->at("groups"));
      part->erase("groups");
      manifest = *std::move(part);
      continue;
    }
    part->erase("groups");  // a LOCAL part's own copy, which its digest stands for
    if (*part != manifest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", name, "': server ", rank, "'s part disagrees with server 0's (versions, layouts or settings)"));
    }
  }
  manifest.erase(kGroupsDigest);
  if (groups.has_value()) manifest["groups"] = *std::move(groups);
  if (manifest.value("kind", "") == "sharded") {
    // One index of where every piece of every tensor lives, so that a loading server
    // reads only this file and the pieces it needs.
    std::vector<std::string> shard_files;
    for (const auto& entry : files) shard_files.push_back(entry.first);
    FLATSHARD_ASSIGN_OR_RETURN(const std::string index, ShardedIndexJson(dir, shard_files));
    FLATSHARD_RETURN_IF_ERROR(AddShardedIndex(dir, index, files));
  }
  return WriteManifest(root_, dir, final_dir, name, std::move(manifest), files);
}

namespace {

// Checkpoint `name` in `root` as its manifest describes it; nullopt without a manifest of
// the right shape (loading it says what is wrong).
std::optional<CheckpointInfo> CompleteCheckpoint(const std::string& root, const std::string& name) {
  absl::StatusOr<Json> manifest = ReadJson(absl::StrCat(root, "/", name, "/", kManifest), kBulkKeys);
  if (!manifest.ok()) return std::nullopt;
  CheckpointInfo info;
  info.name = name;
  info.complete = true;
  try {  // nlohmann throws for a manifest of the wrong shape
    info.kind = manifest->value("kind", "");
    info.job = manifest->value("job", "");
    const absl::StatusOr<int64_t> servers = NonNegativeInteger(*manifest, "servers", 0, name);
    if (!servers.ok() || *servers > std::numeric_limits<int>::max()) return std::nullopt;
    info.servers = static_cast<int>(*servers);
    info.optimizer = manifest->value("optimizer", false);
    for (const auto& file : manifest->at("files")) {
      const absl::StatusOr<int64_t> bytes = NonNegativeInteger(file, "bytes", 0, name);
      if (!bytes.ok()) return std::nullopt;
      info.bytes += *bytes;
    }
    for (const auto& group : manifest->at("groups")) {
      const absl::StatusOr<int64_t> version = NonNegativeInteger(group, "version", 0, name);
      if (!version.ok()) return std::nullopt;
      info.versions[group.value("name", "")] = *version;
    }
  } catch (const Json::exception&) {
    return std::nullopt;
  }
  return info;
}

}  // namespace

absl::StatusOr<std::vector<CheckpointInfo>> CheckpointStore::List() const {
  if (root_.empty()) return absl::FailedPreconditionError("this server has no --checkpoint_root");
  std::map<std::string, CheckpointInfo> found;  // by name: a name is listed once
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root_, error)) {
    std::error_code unreadable;  // a symlink loop, say: not a checkpoint
    if (!entry.is_directory(unreadable) || unreadable || entry.is_symlink(unreadable) || unreadable) continue;
    const std::string base = entry.path().filename().string();
    if (absl::StartsWith(base, ".") && absl::EndsWith(base, ".partial")) {
      // Saves of a name being written (or that failed), unless one has committed since
      // the directory was read: then the checkpoint itself may not be among what was read.
      const std::string name = base.substr(1, base.size() - 9);
      std::optional<CheckpointInfo> complete = CompleteCheckpoint(root_, name);
      CheckpointInfo incomplete;
      incomplete.name = name;
      found.emplace(name, complete.value_or(incomplete));
      continue;
    }
    if (std::optional<CheckpointInfo> complete = CompleteCheckpoint(root_, base)) {
      found.insert_or_assign(base, *std::move(complete));
    }
  }
  if (error) return absl::InternalError(absl::StrCat("cannot list '", root_, "': ", error.message()));
  std::vector<CheckpointInfo> result;
  for (auto& [name, info] : found) result.push_back(std::move(info));
  return result;
}

absl::Status CheckpointStore::Delete(const std::string& name) {
  FLATSHARD_ASSIGN_OR_RETURN(const std::string dir, CheckpointDir(name));
  // Held while removing, so that no save of the name begins meanwhile.
  absl::MutexLock lock(&mu_);
  if (saving_.count(name) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(BeingSaved(name, rank_), "; delete it once the save completes"));
  }
  std::error_code error;
  uintmax_t removed = 0;
  for (const std::string& path : {dir, PartialDir(name)}) {
    if (IsSymlink(path)) return absl::FailedPreconditionError(absl::StrCat("'", path, "' is a symlink; refusing"));
    removed += fs::remove_all(path, error);
    if (error) return absl::InternalError(absl::StrCat("cannot delete '", path, "': ", error.message()));
  }
  if (removed == 0) return absl::NotFoundError(absl::StrCat("no checkpoint named '", name, "'"));
  spdlog::info("checkpoint '{}' deleted", name);
  return absl::OkStatus();
}

absl::StatusOr<LoadOmissions> CheckpointStore::PrepareLoad(const std::string& name, const std::string& job,
                                                           uint64_t load_id, PrepareLoadOptions options) {
  FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(name));
  if (load_id == 0)
    return absl::InvalidArgumentError("a load must carry its (non-zero) load_id from its preparation on");
  // From this root, unless it lacks the checkpoint and server 0's root is another.
  bool from_server_zero = false;
  if (root_.empty() || !Exists(absl::StrCat(root_, "/", name, "/", kManifest))) {
    FLATSHARD_ASSIGN_OR_RETURN(from_server_zero, KeptByServerZero(options.home_root_id));
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
  // A hybrid-sharded job loads shard r % S of S into server r of every replica group.
  FLATSHARD_ASSIGN_OR_RETURN(const Placement placement, registry_.job_placement(job));
  absl::StatusOr<StagedCheckpoint> staged;
  // What follows reads the manifest's fields; one of another type, or an array where an
  // object belongs, makes nlohmann throw: damage like any other.
  try {
    staged = StageFromManifest(*manifest_or, dir, from_server_zero, name, job, placement, options.non_strict,
                               {.cancelled = options.cancelled});
  } catch (const Json::exception& error) {
    return absl::DataLossError(absl::StrCat("'", dir, "/", kManifest, "' is malformed: ", error.what()));
  }
  FLATSHARD_RETURN_IF_ERROR(staged.status());
  if (options.cancelled && options.cancelled()) {
    return absl::CancelledError("the client that asked for it went away");
  }
  staged_.Add(load_id, name, job, std::move(staged->groups));
  return std::move(staged->omitted);
}

absl::StatusOr<StagedCheckpoint> CheckpointStore::StageFromManifest(const Json& manifest, const std::string& dir,
                                                                    bool from_server_zero, const std::string& name,
                                                                    const std::string& job, const Placement& placement,
                                                                    bool non_strict, ReaderOptions options) {
  if (!manifest.is_object() || manifest.value("format", "") != kFormat) {
    return absl::DataLossError(absl::StrCat("'", dir, "/manifest.json' is not a ", kFormat, " manifest"));
  }
  using Files = std::map<std::string, ManifestFile>;
  FLATSHARD_ASSIGN_OR_RETURN(Files files, ManifestFiles(manifest, dir));
  CheckpointReader reader =
      from_server_zero ? CheckpointReader(
                             dir, std::move(files), read_buffers_,
                             [this, name](const std::string& file, uint64_t offset, uint64_t length, std::byte* out) {
                               return peers_->ReadCheckpointFile(0, name, file, offset, length, out);
                             },
                             std::move(options))
                       : CheckpointReader(dir, std::move(files), read_buffers_, std::move(options));
  const std::shared_ptr<ProgressCounter> progress = progress_.Start(name, "load");
  return StageCheckpoint(manifest, reader, registry_, name, job, placement.shard, placement.shards, non_strict,
                         progress.get());
}

absl::Status CheckpointStore::CommitLoad(const std::string& name, uint64_t load_id) {
  FLATSHARD_ASSIGN_OR_RETURN(StagedGroups staged, staged_.Take(load_id, name));
  for (StagedGroup& group : staged) {
    FLATSHARD_RETURN_IF_ERROR(group.group->Restore(std::move(group.shard), load_id, group.kept));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
