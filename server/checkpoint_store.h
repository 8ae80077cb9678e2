// CheckpointStore: this server's side of checkpoints (DESIGN.md, "Checkpoints").
//
// Kinds:
//  - FULL: model.safetensors with every tensor of the job by its fqn, in its registered
//    dtype (the fp32 master is cast on the way out; split into model-0000i-of-0000N files
//    plus model.safetensors.index.json above max_file_bytes), and with the optimizer,
//    optimizer.safetensors with "<fqn>.<state>" in fp32 (exp_avg, exp_avg_sq,
//    max_exp_avg_sq, momentum_buffer). All servers write their own byte ranges of the same
//    files in parallel; padding is never written. Loads into any number of servers.
//  - SHARDED: shard-<rank>.safetensors per server with the pieces of the original tensors
//    it owns, in fp32, named "<group>/<fqn>@<first element>" (+ ".<state>"), and
//    index.json (server/sharded_index.h) saying where every piece of every tensor lives.
//    A server loading it reads the index and only the pieces that overlap its new shard:
//    any server count. An export has no index: its shard 0 describes the groups in its
//    metadata instead (core/state_dict_files.h), from which an import writes the index.
//  - LOCAL: local-<rank>.safetensors with each group's flat shard and optimizer state as
//    they are; loads only into the same server count and layout.
// Hybrid-sharded jobs (server/job.h): every replica group holds the same shards, so
// replica group 0 writes them and the checkpoint is that of a cluster of S = N / R
// servers (its manifest says S); a load fills server r with shard r % S in every replica
// group, and an export may read any one replica group.
// The files are written by server/checkpoint_writer.h and read back by
// server/checkpoint_loader.h; this class owns directories, commits and the roots.
//
// Atomicity: each save of a checkpoint is written into a directory of its own,
// "<root>/.<name>.partial/<save id>/"; every server leaves a part-<rank>.json there with
// the extents it wrote (offset, length, XXH3 of each run of contiguous writes of at most
// 4 MiB; server/file_extents.h), the save's settings and a digest of its group specs
// (the specs themselves in server 0's part, and in LOCAL parts).
// Commit (on one server, after all have saved) checks that the parts agree and that the
// extents tile every file, writes manifest.json last (fsync + rename), renames the
// directory to "<root>/<name>" and removes the parts from it. A crash at any point leaves earlier checkpoints intact and the partial
// one listed as incomplete. A server that fails to write its part leaves
// failed-<rank>.json instead (AbandonPart), and the last server to finish its part
// removes the save's directory, so a failed save (a full disk) leaves nothing; so does
// a blocking save whose client never commits it (EndWithoutCommit). Loads
// read through a CheckpointReader, which verifies every extent it reads; they check
// layouts and state names, stage everything in memory (PrepareLoad) and only then
// install (CommitLoad), so a bad checkpoint leaves the group untouched.
//
// Roots: where all servers share one root, each writes its own byte ranges there. Where
// the roots differ, a FULL or SHARDED checkpoint is kept whole in server 0's root (the
// client passes its id as home_root_id): a server with another root streams its part to
// server 0 (PeerClient::WritePart; server 0 writes it through OpenPart/FinishPart, and
// the commit is the same), and reads what it loads from there (ReadFile on server 0,
// verified against the extents as local reads are). LOCAL checkpoints with a root per
// server are committed per server. Names are one path component ([A-Za-z0-9._-], not
// starting with '.'), so nothing escapes the root; symlinks are refused.
//
// Saves of one name: while this server saves `name` (from BeginSave while its
// PendingSave lives, which the SaveCheckpoint stream keeps through a blocking save's
// commit; an async save until it is written and, if last, committed), Save refuses
// `name` (AlreadyExists) and Delete refuses it (FailedPrecondition), so no directory is
// deleted under a writer. Other saves of the name (a failed one, one another server
// began after this server finished its part) write into their own directories, so a
// commit only ever sees its own save's parts and files. The first save to commit takes
// the name; the others' commits are refused (AlreadyExists) and their directories
// removed.
// Thread-safe.
#ifndef FLATSHARD_SERVER_CHECKPOINT_STORE_H_
#define FLATSHARD_SERVER_CHECKPOINT_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/checkpoint_import.h"
#include "server/checkpoint_loader.h"
#include "server/checkpoint_progress.h"
#include "server/checkpoint_reader.h"
#include "server/checkpoint_sink.h"
#include "server/checkpoint_writer.h"
#include "server/peer_client.h"
#include "server/registry.h"
#include "server/staged_loads.h"

namespace flatshard::server {

struct SaveOptions {
  // Return once the shards are snapshotted; the bytes are written in the background.
  bool async = false;
  // LOCAL: every server has a root of its own and commits its own part.
  bool root_per_server = false;
  // FULL and SHARDED: the id of server 0's root, where the checkpoint is kept; a server
  // whose root has another id streams its part there. Empty: this server's root.
  std::string home_root_id;
  // Names this save on every server ([A-Za-z0-9._-]; the client draws a random one per
  // save): its directory, which no other save of the name shares (empty: "unnamed").
  std::string save_id;
};

// One server's part of a save from CheckpointStore::BeginSave until it is destroyed: the
// name claimed, the save's directory made and, once PinSave succeeded, every group of the
// job pinned at the cut (their next optimizer step waits). FinishSave releases the pins
// (a blocking save once its part is written; an async one once the cut is copied, and
// the claim then goes with the background write). Destroying it releases the claim and,
// before FinishSave, removes the save's (empty) directory: the save did not happen. Owned
// by the one caller that drives the save; not thread-safe.
class PendingSave {
 public:
  PendingSave(const PendingSave&) = delete;
  PendingSave& operator=(const PendingSave&) = delete;
  ~PendingSave();

 private:
  friend class CheckpointStore;
  PendingSave() = default;

  std::string name_;
  CheckpointKind kind_ = CheckpointKind::kFull;
  bool optimizer_ = false;
  std::string job_;
  SaveOptions options_;
  int servers_ = 0;              // in the checkpoint: one replica group's
  bool to_server_zero_ = false;  // the part is streamed to server 0's root
  std::string dir_;              // the save's directory here, unless streamed
  // Its row in the server's status, kept through a blocking save's commit (as the name
  // is). Declared before claim_, so that it goes after it: a save whose row is gone no
  // longer holds the name.
  std::shared_ptr<ProgressCounter> progress_;
  std::shared_ptr<const std::string> claim_;
  std::map<std::string, int64_t> versions_;  // the cut pinned
  std::vector<SavedShard> shards_;           // pinned at versions_
  bool writing_ = false;                     // FinishSave has begun
};

// An import into this root (CheckpointStore::BeginImport) until it is destroyed: the name
// claimed, and the import's directory, which sink() fills. Destroyed before CommitImport
// succeeded, it removes the directory: nothing of the import stays. Its status row goes
// last, once the name is free. Owned by the one caller that drives the import; not
// thread-safe.
class PendingImport {
 public:
  PendingImport(const PendingImport&) = delete;
  PendingImport& operator=(const PendingImport&) = delete;
  ~PendingImport();

  CheckpointSink& sink() { return *sink_; }
  // Its row in the server's status ("import"): the caller counts the bytes it receives.
  ProgressCounter& progress() { return *progress_; }

 private:
  friend class CheckpointStore;
  PendingImport() = default;

  std::string name_;
  std::string import_id_;
  std::string dir_;
  std::shared_ptr<const std::string> claim_;
  std::unique_ptr<DirectorySink> sink_;
  std::shared_ptr<ProgressCounter> progress_;
  bool committed_ = false;
};

// This server's shards of a job pinned at an export's cut (CheckpointStore::PinExport);
// the pins go with it.
struct PinnedExport {
  int shard = 0;  // the shard index the files are named by (hybrid: within the replica group)
  std::vector<SavedShard> shards;
};

struct CheckpointInfo {
  std::string name;
  bool complete = false;
  std::string kind;  // empty for an incomplete one
  std::string job;
  int servers = 0;
  bool optimizer = false;
  int64_t bytes = 0;
  std::map<std::string, int64_t> versions;  // group -> version
};

// How CheckpointStore::PrepareLoad reads and stages a load.
struct PrepareLoadOptions {
  std::string home_root_id;  // server 0's root, read where this one lacks the checkpoint
  // Asked before each read (may be empty): once it says true (the client went away), the
  // load stops, Cancelled, and nothing is staged, rather than hold a copy of the shards
  // that no one will commit.
  std::function<bool()> cancelled;
  bool non_strict = false;  // StageCheckpoint's
};

class CheckpointStore {
 public:
  // `root` empty: every call fails with FailedPrecondition (no --checkpoint_root).
  // FULL files above `max_file_bytes` of data are split Hugging Face style
  // (model-00001-of-0000N.safetensors + model.safetensors.index.json). `peers` (may be
  // null: then every root must be shared) must outlive the store. A load staged here
  // and not committed within `staged_load_timeout` is dropped (server/staged_loads.h).
  CheckpointStore(Registry& registry, int rank, int num_servers, std::string root,
                  uint64_t max_file_bytes = 5'000'000'000, PeerClient* peers = nullptr,
                  absl::Duration staged_load_timeout = absl::Minutes(10));
  ~CheckpointStore();  // waits for asynchronous saves in progress

  // Writes this server's part of checkpoint `name` of `job` at `versions` (every group
  // of the job, each waited for until `deadline`). AlreadyExists if `name` is committed
  // or this server is still saving it.
  // Blocking: the groups are pinned at `versions` and written from their live shards (no
  // copy); their next optimizer step waits until the save returns.
  // Async: returns once the shards are snapshotted (training may go on); the bytes are
  // written in the background and the last server to finish commits (with a root per
  // server, LOCAL: each server commits its own part). A failure is then logged and the
  // checkpoint stays listed as incomplete.
  // Aborted, naming the group, if a group is past its version at `versions` (training
  // overtook the cut). Save is BeginSave, PinSave and FinishSave in one.
  [[nodiscard]] absl::Status Save(const std::string& name, CheckpointKind kind, bool optimizer,
                                  const std::string& job,
                                  const std::map<std::string, int64_t>& versions,
                                  absl::Time deadline, const SaveOptions& options = {});
  // The same save in steps, so that the servers agree on the cut before any writes (the
  // SaveCheckpoint stream): BeginSave checks the request and claims `name`; PinSave pins
  // every group of the job at `versions` (waiting until `deadline` for one behind), again
  // at a later cut if called again; Aborted if a group has moved past its version, and
  // then nothing stays pinned. FinishSave writes the pinned cut as Save does; a blocking
  // save keeps `name` claimed until `save` is destroyed, so that the caller can commit
  // before another save of the name begins here. A blocking save asks `cancelled` (may be
  // empty) before every slice it writes: once it says true (the client went away), the
  // save stops, Cancelled, its part goes and its pins with it, rather than keep training
  // waiting for a part no one will commit.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<PendingSave>> BeginSave(const std::string& name, CheckpointKind kind,
                                                                       bool optimizer, const std::string& job,
                                                                       const SaveOptions& options);
  [[nodiscard]] absl::Status PinSave(PendingSave& save, const std::map<std::string, int64_t>& versions,
                                     absl::Time deadline);
  [[nodiscard]] absl::Status FinishSave(PendingSave& save, absl::Time deadline,
                                        std::function<bool()> cancelled = nullptr);
  // The versions of `job`'s groups on this server now.
  std::map<std::string, int64_t> JobVersions(const std::string& job) const;
  // A random id stored in the root (created by the first server to ask): servers with
  // equal ids share the root. Empty without a root.
  [[nodiscard]] absl::StatusOr<std::string> RootId();
  // An export in two steps, so that every server pins one cut before any streams (the
  // ExportStateDict stream): PinExport pins this server's shards of `job` at `versions`
  // (Group::Pin: their next optimizer step waits until the PinnedExport is gone; Aborted
  // if a group has moved past its version), and Export streams this server's part of a
  // FULL or SHARDED state dict of them (the same files a save writes, without manifest)
  // into `sink`, in slices of at most 4 MiB of data. Nothing is copied.
  [[nodiscard]] absl::StatusOr<PinnedExport> PinExport(const std::string& job,
                                                       const std::map<std::string, int64_t>& versions,
                                                       absl::Time deadline) const;
  [[nodiscard]] absl::Status Export(CheckpointSink& sink, CheckpointKind kind, bool optimizer,
                                    const PinnedExport& pinned) const;
  // A blocking save whose part FinishSave wrote, and whose client then ended the stream
  // without a commit (it went away, or cancelled the save just before its commit): no
  // commit can come any more. The server that would have committed it (server 0, which
  // holds every part; with a root per server, each) abandons it as AbandonPart does, so
  // that its files go once no part is still being written; the other servers leave
  // their parts to it.
  void EndWithoutCommit(const PendingSave& save);
  // Completes save `save_id` of a checkpoint once every server saved its part; OK if this
  // save is committed already (by a server sharing the root). With a root per server
  // (other parts absent), a LOCAL checkpoint is committed per server: its manifest lists
  // this server's files only. FailedPrecondition naming the missing or disagreeing part
  // otherwise; DataLoss for a part description of the wrong shape; AlreadyExists if
  // another save of the name committed first (this save's files are removed).
  [[nodiscard]] absl::Status Commit(const std::string& name, const std::string& save_id = "");

  // Server 0's side of a part that a server with another root streams here: OpenPart
  // gives the sink for its files (in this root's directory of save `save_id` of `name`;
  // AlreadyExists if `name` is committed), FinishPart records the part (`part`: the
  // sender's description, which must name the same save; the extents are the ones the
  // sink wrote) and, for an async save, commits once every part is in; if another part
  // was abandoned and this was the last, it removes the save's directory.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<DirectorySink>> OpenPart(const std::string& name,
                                                                        const std::string& save_id);
  [[nodiscard]] absl::Status FinishPart(const std::string& name, const std::string& save_id, int rank,
                                        const DirectorySink& sink, const std::string& part, bool async);
  // Part `rank` of save `save_id` of `name` could not be written here (by this server,
  // or by a server streaming it to this root), so the save can never commit: leaves
  // "failed-<rank>.json" (`servers`: how many parts the save has, 0 if unknown; `error`)
  // in place of the part, and the last server to finish its part removes the save's
  // directory (RemoveIfAbandoned). With a root per server the directory holds this part
  // alone and goes at once. Best effort: a save whose marker cannot be written stays,
  // listed as incomplete.
  void AbandonPart(const std::string& name, const std::string& save_id, int rank, int servers, bool root_per_server,
                   const absl::Status& error);
  // An import (ImportCheckpoint; server/checkpoint_import.h): server 0 receives a FULL or
  // SHARDED state dict's files through the sink of BeginImport, into a directory of their
  // own as a save's part, and CommitImport checks them, describes them (DescribeImport,
  // with `version` where the files do not say, without optimizer state if
  // `weights_only`) and commits them as checkpoint `name` of that kind (SHARDED with its
  // index.json) with a manifest of the extents the sink hashed. BeginImport:
  // FailedPrecondition on another server than 0 (whose root keeps FULL and SHARDED
  // checkpoints) or without a root, AlreadyExists if `name` is committed or being saved
  // here. CommitImport: InvalidArgument for a file not sent whole or files that are not
  // a state dict (the import then leaves nothing, once destroyed); AlreadyExists if a
  // save of the name committed meanwhile.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<PendingImport>> BeginImport(const std::string& name);
  [[nodiscard]] absl::StatusOr<ImportedCheckpoint> CommitImport(PendingImport& import, int64_t version,
                                                                bool weights_only);
  // `length` bytes (0: to the end) at `offset` of `file` of committed checkpoint `name`,
  // handed to `emit` in pieces of at most 4 MiB, for a server loading it from this root.
  // NotFound, or DataLoss if the file ends first; `emit`'s error stops the read.
  [[nodiscard]] absl::Status ReadFile(const std::string& name, const std::string& file, uint64_t offset,
                                      uint64_t length,
                                      const std::function<absl::Status(absl::Span<const std::byte>)>& emit) const;

  [[nodiscard]] absl::StatusOr<std::vector<CheckpointInfo>> List() const;
  // Saves (their tensor bytes written; a blocking one until it commits) and loads (bytes
  // read) running on this server.
  std::vector<ProgressRow> Progress() { return progress_.Rows(); }
  // Removes checkpoint `name`, complete or not. NotFound if there is none;
  // FailedPrecondition while this server is saving it.
  [[nodiscard]] absl::Status Delete(const std::string& name);

  // Reads and checks what this server needs of checkpoint `name` into memory: from this
  // root, or where it lacks the checkpoint and `home_root_id` is another root's, from
  // server 0's, and stages it as load `load_id` (non-zero; the client's id for this load,
  // the same on every server); returns what a non-strict load leaves out. NotFound, DataLoss
  // (checksum, truncation; naming the file) or FailedPrecondition (layout, tensor, dtype
  // or optimizer mismatch, naming it). Nothing is installed.
  [[nodiscard]] absl::StatusOr<LoadOmissions> PrepareLoad(const std::string& name, const std::string& job,
                                                          uint64_t load_id, PrepareLoadOptions options = {});
  // Installs what PrepareLoad staged as load `load_id` of `name` (Group::Restore).
  // FailedPrecondition if nothing is staged (saying why, when it was dropped).
  [[nodiscard]] absl::Status CommitLoad(const std::string& name, uint64_t load_id);
  void AbortLoad(uint64_t load_id) { staged_.Abort(load_id); }
  // Holds load `load_id` of `name` for another staged_load_timeout() (StagedLoads::Renew).
  [[nodiscard]] absl::Status RenewLoad(const std::string& name, uint64_t load_id) {
    return staged_.Renew(load_id, name);
  }
  absl::Duration staged_load_timeout() const { return staged_.timeout(); }
  // `job` was deleted: drops the loads staged for it (their memory with them); their
  // commits are then FailedPrecondition.
  void DropStagedLoads(const std::string& job) { staged_.DropJob(job); }
  // The loads staged here and waiting for their commit.
  std::vector<StagedLoadRow> StagedLoadRows() const { return staged_.Rows(); }

 private:
  absl::StatusOr<std::string> CheckpointDir(const std::string& name) const;
  // Where the saves of `name` that have not committed are, each in a directory of its own.
  std::string PartialDir(const std::string& name) const { return root_ + "/." + name + ".partial"; }
  std::string SaveDir(const std::string& name, const std::string& save_id) const {
    return PartialDir(name) + "/" + (save_id.empty() ? "unnamed" : save_id);
  }
  // Creates SaveDir(name, save_id); AlreadyExists if `name` is committed.
  absl::StatusOr<std::string> CreateSaveDir(const std::string& name, const std::string& save_id) const;
  // FinishPart's work on the part description as JSON: this server's own part goes
  // straight here, without a trip through text (MBs of group specs for many groups).
  absl::Status RecordPart(const std::string& name, const std::string& save_id, int rank, const DirectorySink& sink,
                          nlohmann::json part, bool async);
  // Commit's work; may throw nlohmann::json::exception for a part description of the
  // wrong shape (Commit catches it).
  absl::Status CommitParts(const std::string& name, const std::string& save_id);
  // `status`, or AlreadyExists if it is an error because another save than `save_id`
  // committed `name` meanwhile (taking this save's directory with it).
  absl::Status UnlessCommittedMeanwhile(const std::string& name, const std::string& save_id,
                                        const absl::Status& status) const;
  // Commits `name` if all `parts` parts of save `save_id` are in its directory and no one
  // else has begun to.
  absl::Status CommitIfComplete(const std::string& name, const std::string& save_id, int parts);
  // Removes the directory of save `save_id` of `name` once every part is in or abandoned
  // and one was abandoned: the last server to finish its part cleans up, so none meets a
  // directory removed under it.
  void RemoveIfAbandoned(const std::string& name, const std::string& save_id);
  // Removes save `save_id` of `name` with its files, and the name's partial directory if
  // no other save of the name is in it. Errors are ignored: what stays is listed as
  // incomplete.
  void RemoveSave(const std::string& name, const std::string& save_id) const;
  // Marks `name` as being saved by this server until the returned handle is released;
  // AlreadyExists if it already is.
  absl::StatusOr<std::shared_ptr<const std::string>> ClaimName(const std::string& name);
  // Joins the asynchronous saves that have finished.
  void ReapFinishedSaves() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How many parts a save has, as its part description `part` says ("servers": the
  // servers of one replica group, for a hybrid-sharded job); the cluster's size where it
  // says nothing valid (null for a part that is not there, or a damaged one).
  int PartsExpected(const nlohmann::json& part) const;
  // PrepareLoad's work once the manifest is read: checks it, reads and verifies what this
  // server loads (from server 0 when `from_server_zero`) and stages it. May throw
  // nlohmann::json::exception for a manifest of the wrong shape (PrepareLoad catches it).
  absl::StatusOr<StagedCheckpoint> StageFromManifest(const nlohmann::json& manifest, const std::string& dir,
                                                     bool from_server_zero, const std::string& name,
                                                     const std::string& job, const Placement& placement, bool non_strict,
                                                     ReaderOptions options);
  // Whether a FULL or SHARDED checkpoint is kept in server 0's root rather than this one.
  absl::StatusOr<bool> KeptByServerZero(const std::string& home_root_id);
  Registry& registry_;
  const int rank_;
  const int num_servers_;
  const std::string root_;
  const uint64_t max_file_bytes_;
  PeerClient* const peers_;
  absl::Mutex mu_;
  StagedLoads staged_;
  struct AsyncSave {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;  // set as the thread's last act
  };
  std::vector<AsyncSave> background_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> saving_ ABSL_GUARDED_BY(mu_);  // names this server is saving
  ReadBufferPool read_buffers_;  // loads' read buffers, kept between loads
  CheckpointProgress progress_;
  std::string root_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_STORE_H_
