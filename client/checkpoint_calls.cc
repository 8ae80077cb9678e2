#include "client/checkpoint_calls.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/checkpoint_cut.h"
#include "client/cut_streams.h"
#include "client/export_files.h"
#include "client/import_files.h"
#include "client/load_leases.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "proto/convert.h"

namespace flatshard::client_internal {
namespace {

// A LOCAL save over roots that differ needs one root per server: where only some
// servers share one, neither the shared nor the per-server commit fits.
absl::Status CheckRootPerServer(const std::vector<std::string>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    for (size_t j = i + 1; j < ids.size(); ++j) {
      if (ids[i] != ids[j]) continue;
      return absl::FailedPreconditionError(
          absl::StrCat("servers ", i, " and ", j,
                       " share a --checkpoint_root that other servers do not; LOCAL "
                       "checkpoints need one root shared by all servers or one root per server"));
    }
  }
  return absl::OkStatus();
}

// Whether each server writes its part of a save or export of `job`: all of them, but
// for a hybrid-sharded job only replica group 0, since the others hold the same shards.
std::vector<bool> Writers(const std::string& job, const std::vector<v1::ServerStatus>& statuses) {
  std::vector<bool> writers;
  for (const v1::ServerStatus& status : statuses) {
    bool writer = true;
    for (const v1::GroupStatus& group : status.groups()) {
      if (group.job() == job && group.replica() != 0) writer = false;
    }
    writers.push_back(writer);
  }
  return writers;
}

// Every server's checkpoint root id (empty: no root; equal ids: a shared root).
std::vector<std::string> RootIds(const std::vector<v1::ServerStatus>& statuses) {
  std::vector<std::string> ids;
  for (const v1::ServerStatus& status : statuses) ids.push_back(status.checkpoint_root_id());
  return ids;
}

// Why a save or delete of `name` is refused: a server still writing (or, blocking,
// committing) its part of a save of it, if any (empty otherwise).
std::string BeingSaved(const std::string& name, const std::vector<v1::ServerStatus>& statuses) {
  for (size_t i = 0; i < statuses.size(); ++i) {
    for (const v1::CheckpointProgress& row : statuses[i].checkpoints_in_progress()) {
      if (row.name() == name && row.operation() == "save") {
        return absl::StrCat("checkpoint '", name, "' is being saved (server ", i,
                            " is still writing or committing its part)");
      }
    }
  }
  return "";
}

// How long a server may wait for a save's or export's cut: the per-call timeout (the
// call itself lasts as long as the checkpoint takes).
uint64_t CutWaitMs(const ControlPlane& control) {
  return static_cast<uint64_t>(absl::ToInt64Milliseconds(control.timeout()));
}

// 64 random bits.
uint64_t RandomId() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

// A fresh id for one save (16 hex digits): its parts carry it, and commits take no others.
std::string NewSaveId() { return absl::StrFormat("%016x", RandomId()); }

// `status` as the caller of `what` sees it: when `cancellation` was what ended it,
// Cancelled, saying so.
absl::Status UnlessCancelled(const Cancellation& cancellation, absl::string_view what, absl::Status status) {
  if (status.ok() || !cancellation.cancelled()) return status;
  return absl::CancelledError(absl::StrCat(what, " was cancelled; the servers keep nothing of it"));
}

std::string SaveWhat(const std::string& name) { return absl::StrCat("the save of checkpoint '", name, "'"); }

}  // namespace

absl::Status CheckpointCalls::Save(const std::string& name, CheckpointKind kind, bool optimizer, bool async,
                                   const SentSteps& sent, const CutAt& at, const Client::Progress& progress) const {
  CancellationSet::Scope cancellation(cancellations_);
  return UnlessCancelled(*cancellation, SaveWhat(name),
                         Save(*cancellation, name, kind, optimizer, async, sent, at, progress));
}

absl::StatusOr<IncompatibleTensors> CheckpointCalls::Load(const std::string& name, bool non_strict,
                                                          const Client::Progress& progress) const {
  CancellationSet::Scope cancellation(cancellations_);
  absl::StatusOr<IncompatibleTensors> loaded = Load(*cancellation, name, non_strict, progress);
  FLATSHARD_RETURN_IF_ERROR(
      UnlessCancelled(*cancellation, absl::StrCat("the load of checkpoint '", name, "'"), loaded.status()));
  return loaded;
}

absl::Status CheckpointCalls::Export(const std::string& out_dir, CheckpointKind kind, bool optimizer,
                                     const SentSteps& sent, const CutAt& at, const Client::Progress& progress) const {
  CancellationSet::Scope cancellation(cancellations_);
  return UnlessCancelled(*cancellation, absl::StrCat("the export into '", out_dir, "'"),
                         Export(*cancellation, out_dir, kind, optimizer, sent, at, progress));
}

absl::StatusOr<ImportedCheckpoint> CheckpointCalls::Import(const std::string& name, const std::string& in_dir,
                                                           bool optimizer, int64_t version,
                                                           const Client::Progress& progress) const {
  CancellationSet::Scope cancellation(cancellations_);
  absl::StatusOr<ImportedCheckpoint> imported = Import(*cancellation, name, in_dir, optimizer, version, progress);
  FLATSHARD_RETURN_IF_ERROR(UnlessCancelled(
      *cancellation, absl::StrCat("the import of '", in_dir, "' as checkpoint '", name, "'"), imported.status()));
  return imported;
}

absl::Status CheckpointCalls::Save(Cancellation& cancellation, const std::string& name, CheckpointKind kind,
                                   bool optimizer, bool async, const SentSteps& sent, const CutAt& at,
                                   const Client::Progress& progress) const {
  v1::SaveCheckpointRequest request;
  request.set_async(async);
  request.set_name(name);
  request.set_kind(ToProto(kind));
  request.set_optimizer(optimizer);
  request.set_job(job_);
  request.set_save_id(NewSaveId());
  request.set_cut_wait_ms(CutWaitMs(control_));
  FLATSHARD_ASSIGN_OR_RETURN(const std::vector<v1::ServerStatus> statuses, Statuses(Groups::kWith));
  // A server that is done with an earlier save of the name would take this one while
  // another still writes into the same directory (each server refuses only its own).
  if (const std::string saving = BeingSaved(name, statuses); !saving.empty()) {
    return absl::AlreadyExistsError(absl::StrCat(saving, "; wait until it completes"));
  }
  const std::vector<bool> writers = Writers(job_, statuses);
  std::vector<std::string> root_ids = RootIds(statuses);
  root_ids.resize(std::count(writers.begin(), writers.end(), true));  // replica group 0 leads
  const bool shared =
      std::set<std::string>(root_ids.begin(), root_ids.end()).size() == 1 ||
      std::find(root_ids.begin(), root_ids.end(), "") != root_ids.end();  // the server says why
  if (!shared && kind == CheckpointKind::kLocal) {
    FLATSHARD_RETURN_IF_ERROR(CheckRootPerServer(root_ids));
    request.set_root_per_server(true);
  } else if (!shared) {
    request.set_home_root_id(root_ids[0]);  // kept whole in server 0's root
  }
  FLATSHARD_ASSIGN_OR_RETURN(const auto cut, ChooseCut(job_, statuses, sent, at));
  // Every server pins the cut before any writes (a later one where training overtook a
  // cut of the default kind); server 0 first, which decides between saves of one name.
  using Streams = CutStreams<v1::SaveCheckpointStep, v1::SaveAnswer>;
  Streams streams(control_, writers, &v1::Flatshard::Stub::SaveCheckpoint, &cancellation);
  v1::SaveCheckpointStep first;
  *first.mutable_request() = request;
  const auto server_zero_now = ServerVersions(job_, statuses[0]);
  FLATSHARD_RETURN_IF_ERROR(ExplainWait(
      streams.Pin(first, cut, absl::StrCat("checkpoint '", name, "'"), PinRounds(at), &server_zero_now), sent, at));
  if (async) {
    // Told to write, the servers go on to the commit by themselves.
    if (!cancellation.Seal()) return absl::CancelledError("");
    return streams.Write();
  }
  // Each server answers once its part is written, and holds the name until the commit, so
  // that no other save of it begins meanwhile (one would be told OK, then lose).
  FLATSHARD_RETURN_IF_ERROR(WithProgress(name, "save", progress, [&] {
    return streams.Write([](Streams::Server& server) {
      server.open = server.stream->Read(&server.answer) && server.answer.written();
      return absl::OkStatus();  // otherwise the stream's outcome says why
    });
  }));
  // Cancelled now, the streams end with no commit: server 0 (each, with a root per
  // server) then removes the parts.
  if (!cancellation.Seal()) return absl::CancelledError("");
  // Every part is in server 0's root (shared or not), which commits; with a root per
  // server, each server commits its own LOCAL part.
  std::vector<bool> committers(writers.size(), request.root_per_server());
  committers[0] = true;
  v1::SaveCheckpointStep commit;
  commit.set_commit(true);
  return streams.Close(commit, committers);
}

absl::StatusOr<IncompatibleTensors> CheckpointCalls::Load(Cancellation& cancellation, const std::string& name,
                                                          bool non_strict, const Client::Progress& progress) const {
  v1::LoadCheckpointRequest request;
  request.set_name(name);
  request.set_job(job_);
  request.set_non_strict(non_strict);
  IncompatibleTensors omitted;  // server 0's answer (every server's is the same)
  FLATSHARD_ASSIGN_OR_RETURN(const std::vector<v1::ServerStatus> statuses, Statuses(Groups::kWithout));
  const std::vector<std::string> root_ids = RootIds(statuses);
  // Servers whose roots lack the checkpoint read it from server 0's.
  if (std::set<std::string>(root_ids.begin(), root_ids.end()).size() > 1)
    request.set_home_root_id(root_ids[0]);
  // Names the load in every phase: what each server stages, then installs.
  uint64_t load_id = 0;
  while (load_id == 0) load_id = RandomId();
  request.set_load_id(load_id);
  std::vector<absl::Status> answers(control_.size());  // by rank, of the last phase
  // Keeps the staging of the servers that prepared while the others still prepare.
  v1::LoadCheckpointRequest renewal = request;
  renewal.set_phase(v1::LoadCheckpointRequest::RENEW);
  LoadLeases leases([&](size_t i) -> absl::StatusOr<absl::Duration> {
    v1::CheckpointResponse response;
    FLATSHARD_RETURN_IF_ERROR(control_.Call(i, &v1::Flatshard::Stub::PrepareAsyncLoadCheckpoint, renewal, &response));
    return absl::Seconds(response.staged_for_seconds());
  });
  auto phase = [&](v1::LoadCheckpointRequest::Phase p) {
    request.set_phase(p);
    return control_.OnAllServersInParallel([&](size_t i) {
      v1::CheckpointResponse response;
      // Only the reads can be cancelled: a commit goes to every server.
      answers[i] =
          control_.Call(i, &v1::Flatshard::Stub::PrepareAsyncLoadCheckpoint, request, &response,
                        control_.model_timeout(), p == v1::LoadCheckpointRequest::PREPARE ? &cancellation : nullptr);
      if (answers[i].ok() && p == v1::LoadCheckpointRequest::PREPARE) {
        leases.Prepared(i, absl::Seconds(response.staged_for_seconds()));
        if (i == 0) {
          omitted.missing.assign(response.missing_tensors().begin(), response.missing_tensors().end());
          omitted.unexpected.assign(response.unexpected_tensors().begin(), response.unexpected_tensors().end());
        }
      }
      return answers[i];
    });
  };
  const absl::Status prepared = WithProgress(name, "load", progress, [&] {
    absl::Status all = phase(v1::LoadCheckpointRequest::PREPARE);
    all.Update(leases.Stop());  // a server dropped its staging while another prepared
    if (all.ok() && !cancellation.Seal()) all = absl::CancelledError("");
    return all;
  });
  if (!prepared.ok()) {
    (void)phase(v1::LoadCheckpointRequest::ABORT);
    return prepared;
  }
  (void)phase(v1::LoadCheckpointRequest::COMMIT);
  FLATSHARD_RETURN_IF_ERROR(LoadCommitOutcome(name, answers));
  return omitted;
}

absl::Status LoadCommitOutcome(const std::string& name, const std::vector<absl::Status>& committed) {
  std::vector<size_t> installed, kept;
  absl::Status first_failure;
  for (size_t rank = 0; rank < committed.size(); ++rank) {
    (committed[rank].ok() ? installed : kept).push_back(rank);
    first_failure.Update(committed[rank]);
  }
  if (installed.empty() || kept.empty()) return first_failure;
  // A server that did not answer may have committed all the same.
  return absl::Status(first_failure.code(),
                      absl::StrCat("checkpoint '", name, "' was installed on server", installed.size() > 1 ? "s " : " ",
                                   absl::StrJoin(installed, ","), ", but server", kept.size() > 1 ? "s " : " ",
                                   absl::StrJoin(kept, ","), " did not confirm it (", first_failure.message(),
                                   "): the job's groups may now hold different states on different servers (`flatshard "
                                   "status` shows each group's load); load the checkpoint again"));
}

// One stream to server 0, which keeps FULL checkpoints: the files, then the commit.
absl::StatusOr<ImportedCheckpoint> CheckpointCalls::Import(Cancellation& cancellation, const std::string& name,
                                                           const std::string& in_dir, bool optimizer, int64_t version,
                                                           const Client::Progress& progress) const {
  FLATSHARD_ASSIGN_OR_RETURN(const std::vector<StateDictFile> files, StateDictFiles(in_dir, optimizer));
  grpc::ClientContext ctx;
  control_.Prepare(ctx, control_.model_timeout());
  const Registration registered(&cancellation, &ctx);
  v1::ImportResponse response;
  const std::unique_ptr<grpc::ClientWriter<v1::ImportMessage>> writer =
      control_.stub(0).ImportCheckpoint(&ctx, &response);
  v1::ImportMessage first;
  first.set_name(name);
  first.set_version(version);
  first.set_weights_only(!optimizer);
  absl::Status sent = writer->Write(first) ? absl::OkStatus() : absl::UnavailableError("");
  // Server 0 answers with its initial metadata once it has taken the name, or ends the
  // call with its refusal (the name exists): no file goes before it has.
  if (sent.ok()) writer->WaitForInitialMetadata();
  if (sent.ok()) sent = SendStateDictFiles(*writer, in_dir, files, export_chunk_bytes_, progress);
  if (sent.ok()) {
    if (!cancellation.Seal()) {  // cancelled, and ctx with it: server 0 drops what it has
      (void)writer->Finish();
      return absl::CancelledError("");
    }
    v1::ImportMessage commit;
    commit.set_commit(true);
    (void)writer->Write(commit);  // a refusal shows in Finish
    writer->WritesDone();
  } else if (!absl::IsUnavailable(sent)) {
    ctx.TryCancel();  // a local error: server 0 drops what it has
    (void)writer->Finish();
    return sent;
  }
  FLATSHARD_RETURN_IF_ERROR(control_.Named(0, writer->Finish()));
  ImportedCheckpoint imported;
  imported.bytes = response.bytes();
  imported.groups.assign(response.groups().begin(), response.groups().end());
  imported.optimizer = response.optimizer();
  FLATSHARD_ASSIGN_OR_RETURN(imported.kind, FromProto(response.kind()));
  return imported;
}

absl::StatusOr<std::vector<CheckpointEntry>> CheckpointCalls::List(std::stop_token stop) const {
  v1::ListCheckpointsResponse response;
  FLATSHARD_RETURN_IF_ERROR(control_.Call(0, &v1::Flatshard::Stub::PrepareAsyncListCheckpoints,
                                          v1::ListCheckpointsRequest(), &response, absl::ZeroDuration(), nullptr,
                                          stop));
  std::vector<CheckpointEntry> entries;
  for (const v1::CheckpointEntry& e : response.checkpoints()) {
    entries.push_back({e.name(), e.complete(), e.kind(), e.job(), e.servers(), e.optimizer(),
                       e.bytes(),
                       std::map<std::string, int64_t>(e.versions().begin(), e.versions().end())});
  }
  return entries;
}

// From every server's root: server 0's answer decides NotFound (with a shared root the
// others find nothing left). Refused while any server still writes a save of it: with a
// shared root, a server that is done would delete the directory under the others.
absl::Status CheckpointCalls::Delete(const std::string& name, std::stop_token stop) const {
  FLATSHARD_ASSIGN_OR_RETURN(const std::vector<v1::ServerStatus> statuses, Statuses(Groups::kWithout, stop));
  if (const std::string saving = BeingSaved(name, statuses); !saving.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(saving, "; delete it once the save completes"));
  }
  v1::CheckpointRequest request;
  request.set_name(name);
  for (int i = 0; i < control_.size(); ++i) {
    v1::CheckpointResponse response;
    const absl::Status deleted = control_.Call(i, &v1::Flatshard::Stub::PrepareAsyncDeleteCheckpoint, request,
                                               &response, absl::ZeroDuration(), nullptr, stop);
    if (!deleted.ok() && (i == 0 || !absl::IsNotFound(deleted))) return deleted;
  }
  return absl::OkStatus();
}

absl::Status CheckpointCalls::Export(Cancellation& cancellation, const std::string& out_dir, CheckpointKind kind,
                                     bool optimizer, const SentSteps& sent, const CutAt& at,
                                     const Client::Progress& progress) const {
  if (kind == CheckpointKind::kLocal)
    return absl::InvalidArgumentError("export: kind must be FULL or SHARDED");
  v1::ExportRequest request;
  request.set_job(job_);
  request.set_kind(ToProto(kind));
  request.set_optimizer(optimizer);
  request.set_chunk_bytes(export_chunk_bytes_);
  request.set_cut_wait_ms(CutWaitMs(control_));
  FLATSHARD_ASSIGN_OR_RETURN(const std::vector<v1::ServerStatus> statuses, Statuses(Groups::kWith));
  FLATSHARD_ASSIGN_OR_RETURN(const auto cut, ChooseCut(job_, statuses, sent, at));
  const std::vector<bool> writers = Writers(job_, statuses);
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  if (error)
    return absl::InternalError(absl::StrCat("cannot create '", out_dir, "': ", error.message()));
  absl::Mutex progress_mu;
  std::map<std::string, uint64_t> sizes;  // every file announced, for the total
  uint64_t done = 0;
  auto report = [&](const v1::ExportChunk& chunk) {
    if (!progress) return;
    absl::MutexLock lock(&progress_mu);
    if (chunk.file_size() > 0) sizes[chunk.file()] = chunk.file_size();
    done += chunk.data().size();
    uint64_t total = 0;
    for (const auto& [file, size] : sizes) total += size;
    progress(done, total);
  };
  // Every server pins the cut before any streams (a later one where training overtook a
  // cut of the default kind).
  using Streams = CutStreams<v1::ExportStep, v1::ExportMessage>;
  Streams streams(control_, writers, &v1::Flatshard::Stub::ExportStateDict, &cancellation);
  v1::ExportStep first;
  *first.mutable_request() = request;
  FLATSHARD_RETURN_IF_ERROR(ExplainWait(streams.Pin(first, cut, "export", PinRounds(at)), sent, at));
  ExportFiles files(out_dir);
  FLATSHARD_RETURN_IF_ERROR(streams.Write([&](Streams::Server& server) {
    const FileSizeLimitAsError file_size_limit;
    v1::ExportMessage message;
    absl::Status written;
    while (written.ok() && server.stream->Read(&message)) {
      written = files.WriteChunk(message.chunk());
      report(message.chunk());
    }
    if (!written.ok()) server.ctx.TryCancel();
    return written;
  }));
  if (!cancellation.Seal()) return absl::CancelledError("");
  return files.Publish();
}

// Fetched from all servers at once.
absl::StatusOr<std::vector<v1::ServerStatus>> CheckpointCalls::Statuses(Groups groups, std::stop_token stop) const {
  std::vector<v1::ServerStatus> statuses(static_cast<size_t>(control_.size()));
  v1::GetStatusRequest request;
  request.set_omit_groups(groups == Groups::kWithout);
  FLATSHARD_RETURN_IF_ERROR(control_.OnAllServersInParallel([&](size_t i) {
    return control_.Call(i, &v1::Flatshard::Stub::PrepareAsyncGetStatus, request, &statuses[i],
                         absl::ZeroDuration(), nullptr, stop);
  }));
  return statuses;
}

// Runs `body`; meanwhile, with `progress`, polls the servers' status a few times a
// second and reports the bytes done and to do of `operation` on checkpoint `name`
// summed over the servers, and done = total once `body` succeeds.
absl::Status CheckpointCalls::WithProgress(const std::string& name, const std::string& operation,
                                           const Client::Progress& progress,
                                           const std::function<absl::Status()>& body) const {
  if (progress == nullptr) return body();
  absl::Notification finished;
  // Per server, the last (done, total) seen; a server that has finished its part leaves
  // the status list, and then counts as done.
  std::vector<std::pair<uint64_t, uint64_t>> seen(static_cast<size_t>(control_.size()));
  uint64_t reported_total = 0;
  v1::GetStatusRequest request;
  request.set_omit_groups(true);  // what it reads is the server's own
  std::thread poller([&] {
    while (!finished.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      for (int i = 0; i < control_.size(); ++i) {
        v1::ServerStatus status;
        if (!control_.Call(i, &v1::Flatshard::Stub::PrepareAsyncGetStatus, request, &status).ok())
          continue;
        auto& [done, total] = seen[static_cast<size_t>(i)];
        done = total;  // unless still listed
        for (const v1::CheckpointProgress& row : status.checkpoints_in_progress()) {
          if (row.name() != name || row.operation() != operation) continue;
          done = row.done();
          total = row.total();
        }
      }
      uint64_t done = 0, total = 0;
      for (const auto& [server_done, server_total] : seen) {
        done += server_done;
        total += server_total;
      }
      if (total > 0 && !finished.HasBeenNotified()) {
        reported_total = total;
        progress(done, total);
      }
    }
  });
  absl::Status status = body();
  finished.Notify();
  poller.join();
  if (status.ok() && reported_total > 0) progress(reported_total, reported_total);
  return status;
}

}  // namespace flatshard::client_internal
