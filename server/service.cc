#include "server/service.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "proto/cluster_info.h"
#include "proto/convert.h"
#include "server/caller_wait.h"
#include "server/hyperparams.h"

namespace flatshard::server {
namespace {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

using ExportStream = grpc::ServerReaderWriter<v1::ExportMessage, v1::ExportStep>;

// What a chunk a peer or client streams here carries (WriteCheckpointPart, ImportCheckpoint)
// into `sink`: its file opened first with `open` (of chunk.file_size, `exclusive` as
// CheckpointSink::Open takes it), its bytes, the file closed last with chunk.close.
absl::Status WriteChunk(CheckpointSink& sink, const v1::ExportChunk& chunk, bool open, bool exclusive) {
  if (open) FLATSHARD_RETURN_IF_ERROR(sink.Open(chunk.file(), chunk.file_size(), exclusive));
  if (!chunk.data().empty()) {
    FLATSHARD_RETURN_IF_ERROR(sink.Write(
        chunk.file(), chunk.offset(),
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(chunk.data().data()), chunk.data().size())));
  }
  if (chunk.close()) FLATSHARD_RETURN_IF_ERROR(sink.Close(chunk.file()));
  return absl::OkStatus();
}

// Export: checkpoint files as a stream of chunks (at most chunk_bytes of data each).
class StreamSink final : public CheckpointSink {
 public:
  StreamSink(ExportStream* stream, size_t chunk_bytes) : stream_(stream), chunk_bytes_(chunk_bytes) {}

  absl::Status Open(const std::string& file, uint64_t size, bool) override {
    v1::ExportMessage message;
    message.mutable_chunk()->set_file(file);
    message.mutable_chunk()->set_file_size(size);
    return Send(message);
  }

  absl::Status Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) override {
    for (size_t done = 0; done < data.size(); done += chunk_bytes_) {
      const size_t count = std::min(chunk_bytes_, data.size() - done);
      v1::ExportMessage message;
      v1::ExportChunk& chunk = *message.mutable_chunk();
      chunk.set_file(file);
      chunk.set_offset(offset + done);
      chunk.set_data(reinterpret_cast<const char*>(data.data() + done), count);
      FLATSHARD_RETURN_IF_ERROR(Send(message));
    }
    return absl::OkStatus();
  }

  absl::Status Close(const std::string& file) override {
    v1::ExportMessage message;
    message.mutable_chunk()->set_file(file);
    message.mutable_chunk()->set_close(true);
    return Send(message);
  }

 private:
  absl::Status Send(const v1::ExportMessage& message) {
    if (!stream_->Write(message)) return absl::CancelledError("the exporting client went away");
    return absl::OkStatus();
  }

  ExportStream* stream_;
  const size_t chunk_bytes_;
};

v1::CutAnswer& CutOf(v1::SaveAnswer& answer) { return *answer.mutable_cut(); }
v1::CutAnswer& CutOf(v1::ExportMessage& message) { return *message.mutable_cut(); }

// The rounds in which the servers of a save or export (`what`) agree on its cut
// (SaveCheckpointStep): `pin` pins this server's groups at the versions asked, and this
// server answers pinned, or overtaken (Aborted) with its versions now, `current()`; the
// client then asks for a later cut or says write. OK once it says write with the cut
// pinned here; `pin`'s other errors as they are.
template <typename Answer, typename Step>
absl::Status AgreeOnCut(grpc::ServerReaderWriter<Answer, Step>* stream, const std::string& what,
                        std::map<std::string, int64_t> versions,
                        const std::function<absl::Status(const std::map<std::string, int64_t>&)>& pin,
                        const std::function<std::map<std::string, int64_t>()>& current) {
  while (true) {
    const absl::Status pinned = pin(versions);
    if (!pinned.ok() && !absl::IsAborted(pinned)) return pinned;
    Answer answer;
    CutOf(answer).set_pinned(pinned.ok());
    if (!pinned.ok()) {
      for (const auto& [group, version] : current()) (*CutOf(answer).mutable_versions())[group] = version;
    }
    Step step;
    if (!stream->Write(answer) || !stream->Read(&step)) {
      return absl::CancelledError(absl::StrCat(what, ": the client went away before every server had pinned the cut"));
    }
    if (step.write()) {
      if (pinned.ok()) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(what, ": 'write' for a cut this server did not pin"));
    }
    versions = std::map<std::string, int64_t>(step.repin().begin(), step.repin().end());
  }
}

// Whether the client of the call on `ctx` has gone (cancelled it, or lost its connection),
// for the waits and the checkpoint work that stop then: asked of gRPC at most every 5 ms.
CallerGone CallerGoneOf(grpc::ServerContext* ctx) {
  return AskedAtMostEvery(absl::Milliseconds(5), [ctx] { return ctx->IsCancelled(); });
}

absl::Time DeadlineOf(const grpc::ServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// How long a call waits for something the client asked for (a version, a norm, a save's
// cut): until shortly before the call's deadline (a tenth of the time left, at most 1 s),
// so that the client gets this server's reason rather than a bare "Deadline Exceeded",
// and a save has let go of its name and pins before its client gives up.
absl::Time WaitDeadline(const grpc::ServerContext* ctx) {
  const absl::Time deadline = DeadlineOf(ctx);
  if (deadline == absl::InfiniteFuture()) return deadline;
  return deadline - std::clamp((deadline - absl::Now()) / 10, absl::ZeroDuration(), absl::Seconds(1));
}

// How long a save or export waits for its cut, over all of its rounds: `cut_wait_ms`
// from now (the client's per-call timeout; its stream lasts as long as the checkpoint
// takes), and never past WaitDeadline.
absl::Time CutWaitDeadline(const grpc::ServerContext* ctx, uint64_t cut_wait_ms) {
  const absl::Time wait = WaitDeadline(ctx);
  if (cut_wait_ms == 0) return wait;
  return std::min(wait, absl::Now() + absl::Milliseconds(std::min<uint64_t>(cut_wait_ms, uint64_t{1} << 40)));
}

}  // namespace

FlatshardService::FlatshardService(ServiceIdentity identity, Registry& registry,
                                   ClipCoordinator& clip, CheckpointStore& checkpoints,
                                   SessionTokens& sessions,
                                   const ServerStats& stats, NcclPlane& nccl,
                                   std::function<std::string()> cluster_check)
    : identity_(std::move(identity)),
      registry_(registry),
      clip_(clip),
      checkpoints_(checkpoints),
      sessions_(sessions),
      stats_(stats),
      nccl_(nccl),
      cluster_check_(std::move(cluster_check)) {}

grpc::Status FlatshardService::Admit(const grpc::ServerContext* ctx) const {
  if (!identity_.auth_token.empty()) {
    const auto& metadata = ctx->client_metadata();
    const auto it = metadata.find("authorization");
    if (it == metadata.end()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing authorization token");
    }
    const absl::string_view presented(it->second.data(), it->second.size());
    if (!ConstantTimeEquals(presented, absl::StrCat("Bearer ", identity_.auth_token))) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong authorization token");
    }
  }
  absl::MutexLock lock(&stop_mu_);
  return ToGrpc(stopped_);
}

void FlatshardService::Stop(absl::Status why) {
  absl::MutexLock lock(&stop_mu_);
  stopped_ = std::move(why);
}

grpc::Status FlatshardService::GetClusterInfo(grpc::ServerContext* ctx,
                                              const v1::GetClusterInfoRequest*,
                                              v1::ClusterInfo* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  response->set_rank(identity_.rank);
  for (const std::string& address : identity_.cluster) response->add_cluster(address);
  response->set_data_address(identity_.data_address);
  response->set_memory(identity_.memory);
  response->set_gpu_uuid(identity_.gpu_uuid);
  response->set_nccl_version(nccl_.version());
  response->set_version(std::string(FlatshardVersion()));
  response->set_protocol(kProtocolRevision);
  return grpc::Status::OK;
}

grpc::Status FlatshardService::OpenSession(grpc::ServerContext* ctx, const v1::OpenSessionRequest*,
                                           v1::OpenSessionResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  response->set_session_token(sessions_.Issue());
  response->set_data_address(identity_.data_address);
  response->set_data_tls(identity_.data_tls);
  return grpc::Status::OK;
}

grpc::Status FlatshardService::OpenNcclChannel(grpc::ServerContext* ctx,
                                               const v1::OpenNcclChannelRequest* request,
                                               v1::OpenNcclChannelResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  absl::StatusOr<uint64_t> channel = nccl_.Open(request->unique_id(), request->worker_rank());
  if (!channel.ok()) return ToGrpc(channel.status());
  response->set_channel(*channel);
  return grpc::Status::OK;
}

grpc::Status FlatshardService::ConfigureJob(grpc::ServerContext* ctx,
                                            const v1::ConfigureJobRequest* request,
                                            v1::ConfigureJobResponse*) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  const v1::JobSettings& proto = request->settings();
  const JobSettings settings{.num_workers = proto.num_workers(),
                             .reduce_mean = proto.reduce() == v1::JobSettings::MEAN,
                             .max_grad_norm = proto.max_grad_norm(),
                             .norm_type = proto.norm_type() == 0 ? 2.0 : proto.norm_type(),
                             .async = proto.mode() == v1::JobSettings::ASYNC,
                             .max_staleness = proto.has_max_staleness() ? proto.max_staleness() : -1,
                             .replicas = proto.replicas() == 0 ? 1 : proto.replicas(),
                             .skip_nonfinite = proto.skip_nonfinite()};
  return ToGrpc(registry_.ConfigureJob(request->job(), settings));
}

grpc::Status FlatshardService::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* request,
                                         v1::DeleteJobResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  if (request->job().empty()) return ToGrpc(absl::InvalidArgumentError("job: empty name"));
  absl::StatusOr<std::vector<std::shared_ptr<Group>>> removed = registry_.DeleteJob(request->job());
  if (absl::IsNotFound(removed.status())) return grpc::Status::OK;  // deleted before, or never configured
  if (!removed.ok()) return ToGrpc(removed.status());
  int64_t bytes = 0;
  for (const std::shared_ptr<Group>& group : *removed) bytes += group->stats().bytes;
  clip_.ForgetJob(request->job());
  checkpoints_.DropStagedLoads(request->job());
  spdlog::info("job '{}' deleted: groups {}, bytes freed {}", request->job(), removed->size(), bytes);
  response->set_deleted(true);
  response->set_freed_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status FlatshardService::RegisterGroup(grpc::ServerContext* ctx,
                                             const v1::RegisterGroupRequest* request,
                                             v1::RegisterGroupResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  if (request->groups().empty()) return ToGrpc(absl::InvalidArgumentError("RegisterGroup names no group"));
  std::vector<Registry::GroupRequest> groups;
  groups.reserve(request->groups_size());
  for (const v1::GroupSpec& spec : request->groups()) {
    absl::StatusOr<std::vector<TensorSpec>> tensors = FromProto(spec.tensors());
    if (!tensors.ok()) return ToGrpc(NamingGroup(spec.group(), tensors.status()));
    absl::StatusOr<OptimizerConfig> optimizer = OptimizerFromProto(spec.optimizer());
    if (!optimizer.ok()) return ToGrpc(NamingGroup(spec.group(), optimizer.status()));
    groups.push_back({spec.group(), *std::move(tensors), spec.align(), *std::move(optimizer)});
  }
  absl::StatusOr<std::vector<Registry::Registration>> registrations =
      registry_.RegisterGroups(request->job(), std::move(groups));
  if (!registrations.ok()) return ToGrpc(registrations.status());
  for (const Registry::Registration& registration : *registrations) {
    const Group& group = *registration.group;
    if (registration.created) {
      spdlog::info(
          "group '{}/{}' registered: tensors {}, elements {}; here shard {} of {} (replica group {}): elements {}, "
          "optimizer {}, bytes {}",
          group.job(), group.name(), group.layout().num_tensors(), group.layout().unpadded_numel(),
          group.placement().shard, group.placement().shards, group.placement().replica, group.shard_numel(),
          group.optimizer_name(), group.stats().bytes);
    }
    v1::RegisteredGroup* registered = response->add_groups();
    registered->set_unpadded_numel(group.layout().unpadded_numel());
    registered->set_shard_numel(group.shard_numel());
    registered->set_version(group.version());
    registered->set_created(registration.created);
  }
  response->set_replicas(registrations->front().group->placement().replicas);  // the job's, alike for all
  return grpc::Status::OK;
}

grpc::Status FlatshardService::InitGroup(grpc::ServerContext* ctx,
                                         const v1::InitGroupRequest* request,
                                         v1::InitGroupResponse*) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  absl::StatusOr<std::shared_ptr<Group>> group = registry_.FindGroup(request->job(), request->group());
  if (!group.ok()) return ToGrpc(group.status());
  return ToGrpc((*group)->InitFromSeed(request->seed()));
}

grpc::Status FlatshardService::SetHyperparams(grpc::ServerContext* ctx,
                                              const v1::SetHyperparamsRequest* request,
                                              v1::SetHyperparamsResponse*) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  return ToGrpc(server::SetHyperparams(registry_, request->job(), *request));
}

grpc::Status FlatshardService::WaitVersion(grpc::ServerContext* ctx,
                                           const v1::WaitVersionRequest* request,
                                           v1::WaitVersionResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  if (request->groups().empty()) return ToGrpc(absl::InvalidArgumentError("WaitVersion names no group"));
  // Every group is found before any wait: a name that is wrong fails the call at once.
  std::vector<std::shared_ptr<Group>> groups;
  groups.reserve(request->groups_size());
  for (const std::string& name : request->groups()) {
    absl::StatusOr<std::shared_ptr<Group>> group = registry_.FindGroup(request->job(), name);
    if (!group.ok()) return ToGrpc(group.status());
    groups.push_back(*std::move(group));
  }
  // One after the other: the groups step meanwhile, so the call lasts as long as the
  // slowest of them takes to get there.
  const absl::Time deadline = WaitDeadline(ctx);
  const CallerGone caller_gone = CallerGoneOf(ctx);
  for (const std::shared_ptr<Group>& group : groups) {
    absl::StatusOr<int64_t> version = group->WaitVersion(request->min_version(), deadline, caller_gone);
    if (!version.ok()) return ToGrpc(version.status());
    response->add_versions(*version);
  }
  return grpc::Status::OK;
}

grpc::Status FlatshardService::SaveCheckpoint(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::SaveAnswer, v1::SaveCheckpointStep>* stream) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  v1::SaveCheckpointStep step;
  if (!stream->Read(&step)) return ToGrpc(absl::InvalidArgumentError("save: empty stream"));
  const v1::SaveCheckpointRequest request = step.request();
  absl::StatusOr<CheckpointKind> kind = FromProto(request.kind());
  if (!kind.ok()) return ToGrpc(kind.status());
  const SaveOptions options{.async = request.async(),
                            .root_per_server = request.root_per_server(),
                            .home_root_id = request.home_root_id(),
                            .save_id = request.save_id()};
  absl::StatusOr<std::unique_ptr<PendingSave>> save =
      checkpoints_.BeginSave(request.name(), *kind, request.optimizer(), request.job(), options);
  if (!save.ok()) return ToGrpc(save.status());
  const absl::Time cut_deadline = CutWaitDeadline(ctx, request.cut_wait_ms());
  const absl::Status agreed = AgreeOnCut(
      stream, "save", {request.versions().begin(), request.versions().end()},
      [&](const std::map<std::string, int64_t>& versions) {
        return checkpoints_.PinSave(**save, versions, cut_deadline);
      },
      [&] { return checkpoints_.JobVersions(request.job()); });
  if (!agreed.ok()) return ToGrpc(agreed);
  // A client gone mid-write (Ctrl-C) would not commit the part: the save stops there.
  const absl::Status written = checkpoints_.FinishSave(**save, DeadlineOf(ctx), CallerGoneOf(ctx));
  if (!written.ok() || request.async()) return ToGrpc(written);
  // The name stays claimed here (`save` lives) until the client, once every server has
  // written its part, has one commit, or closes the stream.
  v1::SaveAnswer answer;
  answer.set_written(true);
  const bool answered = stream->Write(answer) && stream->Read(&step);
  if (answered && step.commit()) return ToGrpc(checkpoints_.Commit(request.name(), request.save_id()));
  // No commit will come (the client went away, or cancelled the save just before it).
  checkpoints_.EndWithoutCommit(**save);
  if (!answered) return grpc::Status::OK;
  return ToGrpc(absl::InvalidArgumentError("save: after 'written', only 'commit' is expected"));
}

grpc::Status FlatshardService::LoadCheckpoint(grpc::ServerContext* ctx, const v1::LoadCheckpointRequest* request,
                                              v1::CheckpointResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  if (request->load_id() == 0) {
    return ToGrpc(absl::InvalidArgumentError("a load must carry its (non-zero) load_id in every phase"));
  }
  switch (request->phase()) {
    case v1::LoadCheckpointRequest::PREPARE: {
      absl::StatusOr<LoadOmissions> omitted = checkpoints_.PrepareLoad(
          request->name(), request->job(), request->load_id(),
          {.home_root_id = request->home_root_id(), .cancelled = CallerGoneOf(ctx), .non_strict = request->non_strict()});
      if (!omitted.ok()) return ToGrpc(omitted.status());
      for (std::string& name : omitted->missing) response->add_missing_tensors(std::move(name));
      for (std::string& name : omitted->unexpected) response->add_unexpected_tensors(std::move(name));
      response->set_staged_for_seconds(absl::ToDoubleSeconds(checkpoints_.staged_load_timeout()));
      return grpc::Status::OK;
    }
    case v1::LoadCheckpointRequest::RENEW: {
      const absl::Status held = checkpoints_.RenewLoad(request->name(), request->load_id());
      response->set_staged_for_seconds(absl::ToDoubleSeconds(checkpoints_.staged_load_timeout()));
      return ToGrpc(held);
    }
    case v1::LoadCheckpointRequest::COMMIT: {
      const absl::Status loaded = checkpoints_.CommitLoad(request->name(), request->load_id());
      // Its steps are taken again from the loaded versions.
      if (loaded.ok()) {
        clip_.OnLoad(request->job(), request->load_id());
        spdlog::info("checkpoint '{}' loaded into job '{}' as load {:x}", request->name(), request->job(),
                     request->load_id());
      }
      return ToGrpc(loaded);
    }
    case v1::LoadCheckpointRequest::ABORT:
      checkpoints_.AbortLoad(request->load_id());
      return grpc::Status::OK;
    default:
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat("unknown load phase ", request->phase())));
  }
}

grpc::Status FlatshardService::ListCheckpoints(grpc::ServerContext* ctx, const v1::ListCheckpointsRequest*,
                                               v1::ListCheckpointsResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  absl::StatusOr<std::vector<CheckpointInfo>> list = checkpoints_.List();
  if (!list.ok()) return ToGrpc(list.status());
  for (const CheckpointInfo& info : *list) {
    v1::CheckpointEntry* entry = response->add_checkpoints();
    entry->set_name(info.name);
    entry->set_complete(info.complete);
    entry->set_kind(info.kind);
    entry->set_job(info.job);
    entry->set_servers(info.servers);
    entry->set_optimizer(info.optimizer);
    entry->set_bytes(info.bytes);
    entry->mutable_versions()->insert(info.versions.begin(), info.versions.end());
  }
  return grpc::Status::OK;
}

grpc::Status FlatshardService::DeleteCheckpoint(grpc::ServerContext* ctx, const v1::CheckpointRequest* request,
                                                v1::CheckpointResponse*) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  return ToGrpc(checkpoints_.Delete(request->name()));
}

grpc::Status FlatshardService::ExportStateDict(grpc::ServerContext* ctx, ExportStream* stream) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  v1::ExportStep step;
  if (!stream->Read(&step)) return ToGrpc(absl::InvalidArgumentError("export: empty stream"));
  const v1::ExportRequest request = step.request();
  absl::StatusOr<CheckpointKind> kind = FromProto(request.kind());
  if (!kind.ok()) return ToGrpc(kind.status());
  if (*kind == CheckpointKind::kLocal) {
    return ToGrpc(absl::InvalidArgumentError("export: kind must be full or sharded"));
  }
  if (request.chunk_bytes() > (64u << 20)) {
    return ToGrpc(absl::InvalidArgumentError("export: chunk_bytes is at most 64 MiB"));
  }
  std::optional<PinnedExport> pinned;
  const absl::Time cut_deadline = CutWaitDeadline(ctx, request.cut_wait_ms());
  const absl::Status agreed = AgreeOnCut(
      stream, "export", {request.versions().begin(), request.versions().end()},
      [&](const std::map<std::string, int64_t>& versions) {
        pinned.reset();  // the pins of an earlier cut, which the groups must get past
        absl::StatusOr<PinnedExport> pins = checkpoints_.PinExport(request.job(), versions, cut_deadline);
        if (!pins.ok()) return pins.status();
        pinned = *std::move(pins);
        return absl::OkStatus();
      },
      [&] { return checkpoints_.JobVersions(request.job()); });
  if (!agreed.ok()) return ToGrpc(agreed);
  StreamSink sink(stream, request.chunk_bytes() == 0 ? size_t{4} << 20 : request.chunk_bytes());
  return ToGrpc(checkpoints_.Export(sink, *kind, request.optimizer(), *pinned));
}

grpc::Status FlatshardService::WriteCheckpointPart(grpc::ServerContext* ctx,
                                                   grpc::ServerReader<v1::CheckpointPartMessage>* reader,
                                                   v1::WriteCheckpointPartResponse*) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  v1::CheckpointPartMessage message;
  if (!reader->Read(&message)) return ToGrpc(absl::InvalidArgumentError("checkpoint part: empty stream"));
  const std::string name = message.name();
  const int rank = message.rank();
  const bool async = message.async();
  const std::string save_id = message.save_id();
  absl::StatusOr<std::unique_ptr<DirectorySink>> sink = checkpoints_.OpenPart(name, save_id);
  if (!sink.ok()) return ToGrpc(sink.status());
  // The part cannot be in this save any more: its sender is told, and the save's files go
  // once no other part is being written.
  auto abandon = [&](const absl::Status& error) {
    checkpoints_.AbandonPart(name, save_id, rank, 0, false, error);
    return ToGrpc(error);
  };
  while (reader->Read(&message)) {
    if (!message.part().empty()) {
      const absl::Status finished = checkpoints_.FinishPart(name, save_id, rank, **sink, message.part(), async);
      return finished.ok() || absl::IsAlreadyExists(finished) ? ToGrpc(finished) : abandon(finished);
    }
    const absl::Status status = WriteChunk(**sink, message.chunk(), message.open(), message.exclusive());
    if (!status.ok()) return abandon(status);
  }
  // The sender went away (or failed) before its last message.
  return abandon(absl::CancelledError(
      absl::StrCat("checkpoint '", name, "': server ", rank, "'s part ended before its description")));
}

grpc::Status FlatshardService::ImportCheckpoint(grpc::ServerContext* ctx, grpc::ServerReader<v1::ImportMessage>* reader,
                                                v1::ImportResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  v1::ImportMessage message;
  if (!reader->Read(&message)) return ToGrpc(absl::InvalidArgumentError("import: empty stream"));
  const std::string name = message.name();
  const int64_t version = message.version();
  const bool weights_only = message.weights_only();
  // Held until the commit; an import that ends any other way leaves nothing.
  absl::StatusOr<std::unique_ptr<PendingImport>> import = checkpoints_.BeginImport(name);
  if (!import.ok()) return ToGrpc(import.status());
  reader->SendInitialMetadata();  // taken: the client sends no file before it sees this
  CheckpointSink& sink = (*import)->sink();
  std::map<std::string, uint64_t> sent;  // every file opened, each once, and its size
  std::set<std::string> open;  // those not closed yet
  auto take = [&](const v1::ImportMessage& message) -> absl::Status {
    const v1::ExportChunk& chunk = message.chunk();
    const std::string& file = chunk.file();
    if (file.empty()) return absl::OkStatus();
    if (message.open()) {
      FLATSHARD_RETURN_IF_ERROR(CheckImportedFileName(file));
      if (!sent.emplace(file, chunk.file_size()).second) {
        return absl::InvalidArgumentError(absl::StrCat("import '", name, "': '", file, "' is sent twice"));
      }
    } else if (open.count(file) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("import '", name, "': a chunk of '", file, "', which is not open"));
    }
    FLATSHARD_RETURN_IF_ERROR(WriteChunk(sink, chunk, message.open(), /*exclusive=*/true));
    ProgressCounter& progress = (*import)->progress();
    if (message.open()) {
      open.insert(file);
      progress.total += chunk.file_size();
    }
    progress.done += chunk.data().size();
    if (chunk.close()) open.erase(file);
    return absl::OkStatus();
  };
  do {
    if (message.commit()) {
      if (!open.empty()) {
        return ToGrpc(absl::InvalidArgumentError(
            absl::StrCat("import '", name, "': '", *open.begin(), "' was not closed before the commit")));
      }
      absl::StatusOr<ImportedCheckpoint> imported = checkpoints_.CommitImport(**import, version, weights_only);
      if (!imported.ok()) return ToGrpc(imported.status());
      uint64_t bytes = 0;
      for (const auto& [file, size] : sent) bytes += size;
      response->set_bytes(bytes);
      for (const std::string& group : imported->groups) response->add_groups(group);
      response->set_optimizer(imported->optimizer);
      response->set_kind(ToProto(imported->kind));
      spdlog::info("checkpoint '{}' imported ({}): {} files, {} bytes", name,
                   std::string(CheckpointKindName(imported->kind)), sent.size(), bytes);
      return grpc::Status::OK;
    }
    if (absl::Status taken = take(message); !taken.ok()) return ToGrpc(taken);
  } while (reader->Read(&message));
  return ToGrpc(absl::CancelledError(absl::StrCat("import '", name, "': the stream ended before its commit")));
}

grpc::Status FlatshardService::ReadCheckpointFile(grpc::ServerContext* ctx,
                                                  const v1::ReadCheckpointFileRequest* request,
                                                  grpc::ServerWriter<v1::ReadCheckpointFileChunk>* writer) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  v1::ReadCheckpointFileChunk chunk;
  return ToGrpc(checkpoints_.ReadFile(request->name(), request->file(), request->offset(), request->length(),
                                      [&](absl::Span<const std::byte> data) {
                                        chunk.set_data(reinterpret_cast<const char*>(data.data()), data.size());
                                        if (!writer->Write(chunk)) return absl::CancelledError("the reader went away");
                                        return absl::OkStatus();
                                      }));
}

grpc::Status FlatshardService::PushNormPartial(grpc::ServerContext* ctx,
                                               const v1::PushNormPartialRequest* request,
                                               v1::PushNormPartialResponse*) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  return ToGrpc(
      clip_.RecordPartial(request->job(), request->step(), request->rank(), request->partial(), request->epoch()));
}

grpc::Status FlatshardService::GetGradNorm(grpc::ServerContext* ctx, const v1::GetGradNormRequest* request,
                                           v1::GetGradNormResponse* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  absl::StatusOr<double> norm = clip_.TotalNorm(request->job(), request->step(), WaitDeadline(ctx), CallerGoneOf(ctx));
  if (!norm.ok()) return ToGrpc(norm.status());
  response->set_norm(*norm);
  return grpc::Status::OK;
}

namespace {

// Adds `group` (its `stats` read once with its GroupStatus) to its job's summary.
void SummarizeGroup(const Group& group, const GroupStats& stats, v1::JobGroupsSummary& summary) {
  summary.set_min_version(summary.groups() == 0 ? stats.version : std::min(summary.min_version(), stats.version));
  summary.set_max_version(summary.groups() == 0 ? stats.version : std::max(summary.max_version(), stats.version));
  summary.set_groups(summary.groups() + 1);
  summary.set_bytes(summary.bytes() + stats.bytes);
  group.reduce_latency().AddTo(summary.mutable_reduce_seconds());
  group.optimizer_latency().AddTo(summary.mutable_optimizer_seconds());
  // Seeded by the load id, so that the same groups with other loads hash apart.
  summary.set_load_digest(summary.load_digest() ^
                          XXH3_64bits_withSeed(group.name().data(), group.name().size(), stats.load_id));
}

}  // namespace

grpc::Status FlatshardService::GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest* request,
                                         v1::ServerStatus* response) {
  if (grpc::Status admitted = Admit(ctx); !admitted.ok()) return admitted;
  *response = Status(*request);
  return grpc::Status::OK;
}

v1::ServerStatus FlatshardService::Status(const v1::GetStatusRequest& request) {
  v1::ServerStatus status;
  v1::ServerStatus* response = &status;
  response->set_rank(identity_.rank);
  response->set_metrics_address(identity_.metrics_address);
  response->set_control_address(identity_.control_address);
  response->set_data_address(identity_.data_address);
  response->set_memory(identity_.memory);
  response->set_gpu_uuid(identity_.gpu_uuid);
  response->set_nccl_version(nccl_.version());
  response->set_tls(identity_.tls);
  response->set_tls_client_certificates(identity_.tls_client_certificates);
  response->set_data_tls(identity_.data_tls);
  if (identity_.tls_expiry) response->set_tls_expiry_unix_seconds(absl::ToUnixSeconds(identity_.tls_expiry()));
  response->set_compute_threads(identity_.compute_threads);
  absl::flat_hash_map<std::string, v1::JobGroupsSummary*> summaries;
  for (const auto& [name, settings] : registry_.jobs()) {
    v1::JobStatus* job = response->add_jobs();
    if (request.summarize_groups()) summaries[name] = job->mutable_summary();
    job->set_job(name);
    job->set_num_workers(settings.num_workers);
    job->set_mode(settings.async ? "async" : "sync");
    job->set_max_grad_norm(settings.max_grad_norm);
    job->set_replicas(settings.replicas);
    job->set_skip_nonfinite(settings.skip_nonfinite);
    const ClipCoordinator::JobNorms norms = clip_.Norms(name);
    job->set_last_norm_step(norms.last_step);
    job->set_last_grad_norm(norms.last_norm);
    job->set_skipped_steps(norms.skipped_steps);
  }
  const bool listed = !request.omit_groups();
  const std::vector<std::shared_ptr<Group>> groups =
      listed || !summaries.empty() ? registry_.groups() : std::vector<std::shared_ptr<Group>>{};
  for (const auto& group : groups) {
    const GroupStats stats = group->stats();
    if (const auto summary = summaries.find(group->job()); summary != summaries.end()) {
      SummarizeGroup(*group, stats, *summary->second);
    }
    if (!listed) continue;
    v1::GroupStatus* proto = response->add_groups();
    proto->set_job(group->job());
    proto->set_group(group->name());
    proto->set_version(stats.version);
    proto->set_unpadded_numel(group->layout().unpadded_numel());
    proto->set_shard_numel(group->shard_numel());
    proto->set_bytes(stats.bytes);
    proto->set_optimizer(group->optimizer_name());
    proto->set_pending_contributions(stats.pending_contributions);
    proto->mutable_step_contributors()->Add(stats.step_contributors.begin(), stats.step_contributors.end());
    proto->set_load_id(stats.load_id);
    proto->set_shard(group->placement().shard);
    proto->set_replica(group->placement().replica);
    group->reduce_latency().ToProto(proto->mutable_reduce_seconds());
    group->optimizer_latency().ToProto(proto->mutable_optimizer_seconds());
  }
  response->set_bytes_received(stats_.bytes_received.load());
  response->set_bytes_sent(stats_.bytes_sent.load());
  response->set_exchange_bytes_sent(stats_.exchange_bytes_sent.load());
  response->set_exchange_bytes_received(stats_.exchange_bytes_received.load());
  response->set_gathers(stats_.gathers.load());
  response->set_scatters(stats_.scatters.load());
  response->set_ipc_gathers(stats_.ipc_gathers.load());
  response->set_ipc_scatters(stats_.ipc_scatters.load());
  response->set_nccl_gathers(stats_.nccl_gathers.load());
  response->set_nccl_scatters(stats_.nccl_scatters.load());
  response->set_errors(stats_.errors.load());
  response->set_open_data_connections(stats_.open_data_connections.load());
  response->set_data_requests_in_flight(stats_.data_requests_in_flight.load());
  response->set_rpcs_in_flight(stats_.rpcs_in_flight.count());
  stats_.data_requests.ToProto(response->mutable_data_request_seconds());
  stats_.rpcs.ToProto(response->mutable_rpc_seconds());
  stats_.rpc_errors.ToProto(response->mutable_rpc_errors());
  response->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  response->set_cluster_check(cluster_check_());
  for (const ProgressRow& row : checkpoints_.Progress()) {
    v1::CheckpointProgress* progress = response->add_checkpoints_in_progress();
    progress->set_name(row.name);
    progress->set_operation(row.operation);
    progress->set_done(row.done);
    progress->set_total(row.total);
  }
  const absl::Time now = absl::Now();
  for (const StagedLoadRow& row : checkpoints_.StagedLoadRows()) {
    v1::StagedLoad* staged = response->add_staged_loads();
    staged->set_name(row.name);
    staged->set_job(row.job);
    staged->set_load_id(row.load_id);
    staged->set_bytes(row.bytes);
    staged->set_age_seconds(absl::ToDoubleSeconds(now - row.staged_at));
    staged->set_expires_in_seconds(absl::ToDoubleSeconds(row.expires_at - now));
  }
  // Empty where the root cannot hold the id (read-only): saves then report the problem.
  if (absl::StatusOr<std::string> root_id = checkpoints_.RootId(); root_id.ok()) {
    response->set_checkpoint_root_id(*root_id);
  }
  return status;
}

}  // namespace flatshard::server
