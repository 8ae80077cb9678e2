#include "flatshard/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/control_channel.h"
#include "client/data_channel.h"
#include "client/device_memory.h"
#include "client/link_pool.h"
#include "client/nccl_link.h"
#include "core/file.h"
#include "core/status_macros.h"
#include "proto/convert.h"
#include "proto/flatshard.grpc.pb.h"
#include "transport/data_protocol.h"

namespace flatshard {
namespace {

using client_internal::DataChannel;

absl::Status FromGrpc(const grpc::Status& status, absl::string_view server) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("server ", server, ": ", status.error_message()));
}

v1::OptimizerSettings OptimizerToProto(const OptimizerOptions& optimizer) {
  v1::OptimizerSettings proto;
  if (const auto* sgd = std::get_if<SgdOptions>(&optimizer)) {
    v1::SgdSettings* out = proto.mutable_sgd();
    out->set_lr(sgd->lr);
    out->set_momentum(sgd->momentum);
    out->set_dampening(sgd->dampening);
    out->set_weight_decay(sgd->weight_decay);
    out->set_nesterov(sgd->nesterov);
  } else {
    const auto& adam = std::get<AdamOptions>(optimizer);
    v1::AdamSettings* out = proto.mutable_adam();
    out->set_lr(adam.lr);
    out->set_beta1(adam.beta1);
    out->set_beta2(adam.beta2);
    out->set_eps(adam.eps);
    out->set_weight_decay(adam.weight_decay);
    out->set_amsgrad(adam.amsgrad);
    out->set_decoupled_weight_decay(adam.decoupled_weight_decay);
  }
  return proto;
}

// The status a split gather ends with when its ranges saw different versions (the
// group stepped meanwhile); the gather is then repeated whole.
constexpr absl::string_view kTornGather = "the ranges of a split gather saw different versions";

// Collects the per-request results of one transfer and completes its promise once.
// With `same_version` (the ranges of one split gather), requests that answered with
// different versions end it with Aborted(kTornGather).
template <typename Result>
class Completion {
 public:
  explicit Completion(int parts, bool same_version = false)
      : remaining_(parts), same_version_(same_version) {}
  std::future<Result> future() { return promise_.get_future(); }

  void Finish(const absl::Status& status, int64_t version) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && status_.ok()) status_ = status;
    if (status.ok()) {
      min_version_ = std::min(min_version_, version);
      max_version_ = std::max(max_version_, version);
    }
    if (--remaining_ > 0) return;
    if (same_version_ && status_.ok() && min_version_ != max_version_) {
      status_ = absl::AbortedError(kTornGather);
    }
    if constexpr (std::is_same_v<Result, absl::Status>) {
      promise_.set_value(status_);
    } else {
      promise_.set_value(status_.ok() ? Result(min_version_) : Result(status_));
    }
  }

 private:
  absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_);
  const bool same_version_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int64_t min_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  int64_t max_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::min();
  std::promise<Result> promise_;
};

template <typename Result>
std::future<Result> ReadyFuture(Result result) {
  std::promise<Result> promise;
  promise.set_value(std::move(result));
  return promise.get_future();
}

// Data connections (and NCCL links) per server: beyond this, threads and sockets are
// wasted and a mistyped option would exhaust the servers' descriptors.
constexpr int kMaxInFlight = 64;

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(ClientOptions options) : options_(std::move(options)) {}

  absl::Status Init() {
    if (options_.servers.empty()) return absl::InvalidArgumentError("servers: empty list");
    if (options_.num_workers < 1 || options_.worker_rank < 0 ||
        options_.worker_rank >= options_.num_workers) {
      return absl::InvalidArgumentError(absl::StrCat("worker_rank ", options_.worker_rank,
                                                     " outside [0, num_workers=",
                                                     options_.num_workers, ")"));
    }
    if (options_.max_in_flight < 1 || options_.max_in_flight > kMaxInFlight) {
      return absl::InvalidArgumentError(absl::StrCat("max_in_flight ", options_.max_in_flight,
                                                     " outside [1, ", kMaxInFlight, "]"));
    }
    if (options_.timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("timeout ", absl::FormatDuration(options_.timeout), " is not positive"));
    }
    if (options_.gather_split_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather_split_bytes ", options_.gather_split_bytes, " is negative"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                               client_internal::ControlPlaneCredentials(options_.tls_ca_file));
    for (size_t i = 0; i < options_.servers.size(); ++i) {
      const std::string& address = options_.servers[i];
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(65 << 20);  // export chunks of up to 64 MiB
      stubs_.push_back(v1::Flatshard::NewStub(grpc::CreateCustomChannel(address, credentials, args)));
      v1::ClusterInfo info;
      FLATSHARD_RETURN_IF_ERROR(client_internal::WithTlsHint(
          Call(i, &v1::Flatshard::Stub::GetClusterInfo, v1::GetClusterInfoRequest(), &info),
          options_.tls_ca_file));
      const std::vector<std::string> cluster(info.cluster().begin(), info.cluster().end());
      if (cluster != options_.servers || info.rank() != static_cast<int>(i)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "server ", address, " is rank ", info.rank(), " of cluster [",
            absl::StrJoin(cluster, ","), "]; this client expects rank ", i, " of [",
            absl::StrJoin(options_.servers, ","), "]"));
      }
      v1::OpenSessionRequest session_request;
      session_request.set_worker_rank(options_.worker_rank);
      v1::OpenSessionResponse session;
      FLATSHARD_RETURN_IF_ERROR(
          Call(i, &v1::Flatshard::Stub::OpenSession, session_request, &session));
      server_gpus_.push_back(info.gpu_uuid());
      server_nccl_.push_back(!info.nccl_version().empty());
      nccl_links_.push_back(std::make_unique<NcclLinks>(
          options_.max_in_flight, [this, i](int device) { return OpenLink(static_cast<int>(i), device); }));
      channels_.push_back(std::make_unique<DataChannel>(
          session.data_address(), session.session_token(), options_.max_in_flight,
          options_.timeout + absl::Seconds(5)));
    }
    // Loading NCCL costs; only a cluster with an NCCL plane needs it.
    nccl_loads_ = std::find(server_nccl_.begin(), server_nccl_.end(), true) != server_nccl_.end() &&
                  client_internal::NcclLink::Available();
    return absl::OkStatus();
  }

  const ClientOptions& options() const override { return options_; }

  absl::Status ConfigureJob(const JobOptions& job) override {
    v1::ConfigureJobRequest request;
    request.set_job(options_.job);
    v1::JobSettings* settings = request.mutable_settings();
    settings->set_num_workers(options_.num_workers);
    settings->set_reduce(job.reduce_mean ? v1::JobSettings::MEAN : v1::JobSettings::SUM);
    settings->set_max_grad_norm(job.max_grad_norm);
    settings->set_norm_type(job.norm_type);
    settings->set_mode(job.async ? v1::JobSettings::ASYNC : v1::JobSettings::SYNC);
    if (job.max_staleness >= 0) settings->set_max_staleness(job.max_staleness);
    v1::ConfigureJobResponse response;
    return CallAll(&v1::Flatshard::Stub::ConfigureJob, request, &response);
  }

  absl::StatusOr<const FlatLayout*> RegisterGroup(const std::string& group,
                                                  std::vector<TensorSpec> tensors, int64_t align,
                                                  const OptimizerOptions& optimizer) override {
    FLATSHARD_ASSIGN_OR_RETURN(FlatLayout layout,
                               FlatLayout::Create(tensors, align, num_servers()));
    v1::RegisterGroupRequest request;
    request.set_job(options_.job);
    request.set_group(group);
    ToProto(tensors, request.mutable_tensors());
    request.set_align(align);
    *request.mutable_optimizer() = OptimizerToProto(optimizer);
    v1::RegisterGroupResponse response;
    FLATSHARD_RETURN_IF_ERROR(CallAll(&v1::Flatshard::Stub::RegisterGroup, request, &response));
    absl::MutexLock lock(&mu_);
    auto& slot = layouts_[group];
    if (slot == nullptr || !(*slot == layout)) slot = std::make_unique<FlatLayout>(std::move(layout));
    return slot.get();
  }

  absl::Status InitGroup(const std::string& group, absl::Span<const float> flat) override {
    FLATSHARD_ASSIGN_OR_RETURN(const FlatLayout* layout, FindLayout(group));
    if (static_cast<int64_t>(flat.size()) != layout->unpadded_numel() &&
        static_cast<int64_t>(flat.size()) != layout->padded_numel()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "initial values for group '", group, "': ", flat.size(), " elements, expected ",
          layout->unpadded_numel(), " (or padded ", layout->padded_numel(), ")"));
    }
    // Each server gets its shard, right-padded with zeros.
    std::vector<std::vector<float>> shards(num_servers());
    for (int rank = 0; rank < num_servers(); ++rank) {
      shards[rank].assign(layout->shard_numel(), 0.0f);
      std::copy(flat.begin() + layout->shard_start(rank), flat.begin() + layout->shard_end(rank),
                shards[rank].begin());
    }
    std::vector<absl::Span<const std::byte>> parts;
    for (const auto& shard : shards) parts.push_back(AsBytes(shard));
    return Transfer<absl::Status>(transport::DataOp::kPushInit, group, 0, DType::kFloat32, parts,
                                  {})
        .get();
  }

  absl::Status InitGroupFromSeed(const std::string& group, uint64_t seed) override {
    v1::InitGroupRequest request;
    request.set_job(options_.job);
    request.set_group(group);
    request.set_seed(seed);
    v1::InitGroupResponse response;
    return CallAll(&v1::Flatshard::Stub::InitGroup, request, &response);
  }

  std::future<absl::StatusOr<int64_t>> Gather(const std::string& group, int64_t min_version,
                                              DType dtype, absl::Span<std::byte> out) override {
    absl::StatusOr<std::vector<absl::Span<std::byte>>> parts = Split(group, dtype, out);
    if (!parts.ok()) return ReadyFuture<absl::StatusOr<int64_t>>(parts.status());
    const int device = client_internal::DeviceOf(out.data());
    if (device >= 0) {
      return DeviceTransfer<absl::StatusOr<int64_t>>(transport::DataOp::kGather, group,
                                                     min_version, dtype, out.data(),
                                                     *std::move(parts), device);
    }
    return HostGather(group, min_version, dtype, *std::move(parts));
  }

  std::future<absl::Status> Scatter(const std::string& group, int64_t step, DType dtype,
                                    absl::Span<const std::byte> grad) override {
    absl::StatusOr<std::vector<absl::Span<std::byte>>> parts =
        Split(group, dtype, absl::MakeSpan(const_cast<std::byte*>(grad.data()), grad.size()));
    if (!parts.ok()) return ReadyFuture<absl::Status>(parts.status());
    const int device = client_internal::DeviceOf(grad.data());
    if (device >= 0) {
      return DeviceTransfer<absl::Status>(transport::DataOp::kScatter, group, step, dtype,
                                          grad.data(), *std::move(parts), device);
    }
    std::vector<absl::Span<const std::byte>> sends(parts->begin(), parts->end());
    return Transfer<absl::Status>(transport::DataOp::kScatter, group, step, dtype, sends, {});
  }

  std::vector<std::string> DataPlanes() const override {
    std::vector<std::string> planes(num_servers(), "tcp");
    const int device = client_internal::CurrentDevice();
    if (device < 0) return planes;
    for (int i = 0; i < num_servers(); ++i) {
      const Plane plane = PlaneFor(i, device, /*exportable=*/true);
      planes[i] = plane == Plane::kCudaIpc ? "cuda-ipc" : plane == Plane::kNccl ? "nccl" : "tcp";
    }
    return planes;
  }

  absl::StatusOr<int64_t> WaitVersion(const std::string& group, int64_t min_version) override {
    v1::WaitVersionRequest request;
    request.set_job(options_.job);
    request.set_group(group);
    request.set_min_version(min_version);
    int64_t version = std::numeric_limits<int64_t>::max();
    for (int i = 0; i < num_servers(); ++i) {
      v1::WaitVersionResponse response;
      FLATSHARD_RETURN_IF_ERROR(Call(i, &v1::Flatshard::Stub::WaitVersion, request, &response));
      version = std::min(version, response.version());
    }
    return version;
  }

  absl::Status SaveCheckpoint(const std::string& name, CheckpointKind kind, bool optimizer, bool async,
                              Progress progress) override {
    v1::SaveCheckpointRequest request;
    request.set_async(async);
    request.set_name(name);
    request.set_kind(KindToProto(kind));
    request.set_optimizer(optimizer);
    request.set_job(options_.job);
    FLATSHARD_ASSIGN_OR_RETURN(const std::vector<std::string> root_ids, CheckpointRootIds());
    const bool shared = std::set<std::string>(root_ids.begin(), root_ids.end()).size() == 1 ||
                        std::find(root_ids.begin(), root_ids.end(), "") != root_ids.end();  // the server says why
    if (!shared && kind == CheckpointKind::kLocal) {
      FLATSHARD_RETURN_IF_ERROR(CheckRootPerServer(root_ids));
      request.set_root_per_server(true);
    } else if (!shared) {
      request.set_home_root_id(root_ids[0]);  // kept whole in server 0's root
    }
    FLATSHARD_RETURN_IF_ERROR(JobCut(*request.mutable_versions()));
    FLATSHARD_RETURN_IF_ERROR(WithProgress(name, "save", async ? nullptr : progress, [&] {
      return OnAllServersInParallel([&](size_t i) {
        v1::SaveCheckpointResponse response;
        return Call(i, &v1::Flatshard::Stub::SaveCheckpoint, request, &response);
      });
    }));
    if (async) return absl::OkStatus();  // the servers commit when they are done
    // Every part is in server 0's root (shared or not), which commits; with a root per
    // server, each server commits its own LOCAL part.
    v1::CheckpointRequest commit;
    commit.set_name(name);
    for (int i = 0; i < (request.root_per_server() ? num_servers() : 1); ++i) {
      v1::CheckpointResponse response;
      FLATSHARD_RETURN_IF_ERROR(Call(i, &v1::Flatshard::Stub::CommitCheckpoint, commit, &response));
    }
    return absl::OkStatus();
  }

  absl::Status LoadCheckpoint(const std::string& name, Progress progress) override {
    v1::LoadCheckpointRequest request;
    request.set_name(name);
    request.set_job(options_.job);
    FLATSHARD_ASSIGN_OR_RETURN(const std::vector<std::string> root_ids, CheckpointRootIds());
    // Servers whose roots lack the checkpoint read it from server 0's.
    if (std::set<std::string>(root_ids.begin(), root_ids.end()).size() > 1) request.set_home_root_id(root_ids[0]);
    auto phase = [&](v1::LoadCheckpointRequest::Phase p) {
      request.set_phase(p);
      return OnAllServersInParallel([&](size_t i) {
        v1::CheckpointResponse response;
        return Call(i, &v1::Flatshard::Stub::LoadCheckpoint, request, &response);
      });
    };
    const absl::Status prepared =
        WithProgress(name, "load", progress, [&] { return phase(v1::LoadCheckpointRequest::PREPARE); });
    if (!prepared.ok()) {
      (void)phase(v1::LoadCheckpointRequest::ABORT);
      return prepared;
    }
    return phase(v1::LoadCheckpointRequest::COMMIT);
  }

  absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints() override {
    v1::ListCheckpointsResponse response;
    FLATSHARD_RETURN_IF_ERROR(Call(0, &v1::Flatshard::Stub::ListCheckpoints, v1::ListCheckpointsRequest(), &response));
    std::vector<CheckpointEntry> entries;
    for (const v1::CheckpointEntry& e : response.checkpoints()) {
      entries.push_back({e.name(), e.complete(), e.kind(), e.job(), e.servers(), e.optimizer(), e.bytes(),
                         std::map<std::string, int64_t>(e.versions().begin(), e.versions().end())});
    }
    return entries;
  }

  // From every server's root: server 0's answer decides NotFound (with a shared root the
  // others find nothing left).
  absl::Status DeleteCheckpoint(const std::string& name) override {
    v1::CheckpointRequest request;
    request.set_name(name);
    for (int i = 0; i < num_servers(); ++i) {
      v1::CheckpointResponse response;
      const absl::Status deleted = Call(i, &v1::Flatshard::Stub::DeleteCheckpoint, request, &response);
      if (!deleted.ok() && (i == 0 || !absl::IsNotFound(deleted))) return deleted;
    }
    return absl::OkStatus();
  }

  absl::Status ExportStateDict(const std::string& out_dir, CheckpointKind kind, bool optimizer,
                               Progress progress) override {
    if (kind == CheckpointKind::kLocal) return absl::InvalidArgumentError("export: kind must be FULL or SHARDED");
    v1::ExportRequest request;
    request.set_job(options_.job);
    request.set_kind(KindToProto(kind));
    request.set_optimizer(optimizer);
    request.set_chunk_bytes(options_.export_chunk_bytes);
    FLATSHARD_RETURN_IF_ERROR(JobCut(*request.mutable_versions()));
    std::error_code error;
    std::filesystem::create_directories(out_dir, error);
    if (error) return absl::InternalError(absl::StrCat("cannot create '", out_dir, "': ", error.message()));
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
    return OnAllServersInParallel([&](size_t i) -> absl::Status {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
      if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
      auto reader = stubs_[i]->ExportStateDict(&ctx, request);
      std::map<std::string, File> files;
      v1::ExportChunk chunk;
      absl::Status written;
      while (written.ok() && reader->Read(&chunk)) {
        written = WriteChunk(out_dir, chunk, files);
        report(chunk);
      }
      if (!written.ok()) ctx.TryCancel();
      const grpc::Status finished = reader->Finish();
      if (!written.ok()) return written;
      return FromGrpc(finished, options_.servers[i]);
    });
  }

  absl::Status SetHyperparams(const std::string& group, const OptimizerOptions& optimizer) override {
    v1::SetHyperparamsRequest request;
    request.set_job(options_.job);
    request.set_group(group);
    *request.mutable_optimizer() = OptimizerToProto(optimizer);
    v1::SetHyperparamsResponse response;
    return CallAll(&v1::Flatshard::Stub::SetHyperparams, request, &response);
  }

 private:
  template <typename Request, typename Response>
  using StubMethod = grpc::Status (v1::Flatshard::Stub::*)(grpc::ClientContext*, const Request&,
                                                          Response*);

  template <typename Request, typename Response>
  absl::Status Call(size_t server, StubMethod<Request, Response> method, const Request& request,
                    Response* response, absl::Duration timeout = absl::ZeroDuration()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(
        absl::Now() + (timeout > absl::ZeroDuration() ? timeout : options_.timeout)));
    if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
    return FromGrpc((stubs_[server].get()->*method)(&ctx, request, response),
                    options_.servers[server]);
  }

  template <typename Request, typename Response>
  absl::Status CallAll(StubMethod<Request, Response> method, const Request& request,
                       Response* response) {
    for (size_t i = 0; i < stubs_.size(); ++i) {
      FLATSHARD_RETURN_IF_ERROR(Call(i, method, request, response));
    }
    return absl::OkStatus();
  }

  static v1::CheckpointKind KindToProto(CheckpointKind kind) {
    switch (kind) {
      case CheckpointKind::kFull:
        return v1::FULL;
      case CheckpointKind::kSharded:
        return v1::SHARDED;
      case CheckpointKind::kLocal:
        return v1::LOCAL;
    }
    return v1::CHECKPOINT_KIND_UNSPECIFIED;
  }

  // The consistent cut of a save or export: every group of the job at the highest
  // version any server has (servers of a synchronous job are at most one step apart;
  // each waits until it gets there).
  absl::Status JobCut(google::protobuf::Map<std::string, int64_t>& versions) {
    for (int i = 0; i < num_servers(); ++i) {
      v1::ServerStatus status;
      FLATSHARD_RETURN_IF_ERROR(Call(i, &v1::Flatshard::Stub::GetStatus, v1::GetStatusRequest(), &status));
      for (const v1::GroupStatus& group : status.groups()) {
        if (group.job() != options_.job) continue;
        versions[group.group()] = std::max(versions[group.group()], group.version());
      }
    }
    return absl::OkStatus();
  }

  // One chunk of an export into `out_dir`: announces, fills or closes a file.
  static absl::Status WriteChunk(const std::string& out_dir, const v1::ExportChunk& chunk,
                                 std::map<std::string, File>& files) {
    const std::string& name = chunk.file();
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') {
      return absl::DataLossError(absl::StrCat("export: the server named a file '", name, "'"));
    }
    auto it = files.find(name);
    if (it == files.end()) {
      FLATSHARD_ASSIGN_OR_RETURN(File file, File::Open(out_dir + "/" + name, File::Mode::kWrite));
      FLATSHARD_RETURN_IF_ERROR(file.Truncate(chunk.file_size()));
      it = files.emplace(name, std::move(file)).first;
    }
    if (!chunk.data().empty()) {
      FLATSHARD_RETURN_IF_ERROR(it->second.WriteAt(
          chunk.offset(), absl::MakeConstSpan(reinterpret_cast<const std::byte*>(chunk.data().data()), chunk.data().size())));
    }
    if (chunk.close()) {
      FLATSHARD_RETURN_IF_ERROR(it->second.Sync());
      files.erase(it);
    }
    return absl::OkStatus();
  }

  // Every server's checkpoint root id (empty: no root; equal ids: a shared root).
  absl::StatusOr<std::vector<std::string>> CheckpointRootIds() {
    std::vector<std::string> ids(static_cast<size_t>(num_servers()));
    FLATSHARD_RETURN_IF_ERROR(OnAllServersInParallel([&](size_t i) {
      v1::ServerStatus status;
      FLATSHARD_RETURN_IF_ERROR(Call(i, &v1::Flatshard::Stub::GetStatus, v1::GetStatusRequest(), &status));
      ids[i] = status.checkpoint_root_id();
      return absl::OkStatus();
    }));
    return ids;
  }

  // A LOCAL save over roots that differ needs one root per server: where only some
  // servers share one, neither the shared nor the per-server commit fits.
  static absl::Status CheckRootPerServer(const std::vector<std::string>& ids) {
    for (size_t i = 0; i < ids.size(); ++i) {
      for (size_t j = i + 1; j < ids.size(); ++j) {
        if (ids[i] != ids[j]) continue;
        return absl::FailedPreconditionError(absl::StrCat(
            "servers ", i, " and ", j, " share a --checkpoint_root that other servers do not; LOCAL "
            "checkpoints need one root shared by all servers or one root per server"));
      }
    }
    return absl::OkStatus();
  }

  // Runs `body`; meanwhile, with `progress`, polls the servers' status a few times a
  // second and reports the bytes done and to do of `operation` on checkpoint `name`
  // summed over the servers, and done = total once `body` succeeds.
  absl::Status WithProgress(const std::string& name, const std::string& operation, const Progress& progress,
                            const std::function<absl::Status()>& body) {
    if (progress == nullptr) return body();
    absl::Notification finished;
    // Per server, the last (done, total) seen; a server that has finished its part leaves
    // the status list, and then counts as done.
    std::vector<std::pair<uint64_t, uint64_t>> seen(static_cast<size_t>(num_servers()));
    uint64_t reported_total = 0;
    std::thread poller([&] {
      while (!finished.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
        for (int i = 0; i < num_servers(); ++i) {
          v1::ServerStatus status;
          if (!Call(i, &v1::Flatshard::Stub::GetStatus, v1::GetStatusRequest(), &status).ok()) continue;
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

  // Runs `call(server index)` for every server at once; the first error wins.
  absl::Status OnAllServersInParallel(const std::function<absl::Status(size_t)>& call) {
    std::vector<std::future<absl::Status>> results;
    for (size_t i = 0; i < stubs_.size(); ++i) results.push_back(std::async(std::launch::async, call, i));
    absl::Status status;
    for (auto& result : results) status.Update(result.get());
    return status;
  }

  absl::StatusOr<const FlatLayout*> FindLayout(const std::string& group) {
    absl::MutexLock lock(&mu_);
    const auto it = layouts_.find(group);
    if (it == layouts_.end()) {
      return absl::NotFoundError(
          absl::StrCat("group '", group, "' was not registered by this client; call RegisterGroup"));
    }
    return it->second.get();
  }

  // Splits a full flat buffer (padded_numel elements of dtype) into per-server slices.
  absl::StatusOr<std::vector<absl::Span<std::byte>>> Split(const std::string& group, DType dtype,
                                                           absl::Span<std::byte> full) {
    FLATSHARD_ASSIGN_OR_RETURN(const FlatLayout* layout, FindLayout(group));
    if (!IsFloatingParamDType(dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", DTypeName(dtype), " is not float32, bfloat16 or float16"));
    }
    const size_t slice = static_cast<size_t>(layout->shard_numel()) * DTypeSize(dtype);
    if (full.size() != slice * num_servers()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer for group '", group, "' holds ", full.size(), " bytes; expected ",
          slice * num_servers(), " (padded_numel ", layout->padded_numel(), " x ",
          DTypeSize(dtype), " bytes of ", DTypeName(dtype), ")"));
    }
    std::vector<absl::Span<std::byte>> parts;
    for (int i = 0; i < num_servers(); ++i) parts.push_back(full.subspan(i * slice, slice));
    return parts;
  }

  // True when server i keeps its shards on the GPU `device` is (CUDA IPC works).
  bool IpcReachable(int server, int device) const {
    if (server_gpus_[server].empty()) return false;
    absl::StatusOr<std::string> uuid = client_internal::DeviceUuid(device);
    return uuid.ok() && *uuid == server_gpus_[server];
  }

  enum class Plane { kTcp, kCudaIpc, kNccl };

  // The plane a buffer on `device` uses with server i (`exportable`: CUDA IPC can share
  // it); ClientOptions::device_plane says how to choose.
  Plane PlaneFor(int server, int device, bool exportable) const {
    const bool ipc = exportable && IpcReachable(server, device);
    const bool nccl = server_nccl_[server] && nccl_loads_;
    switch (options_.device_plane) {
      case DevicePlane::kAuto:
        // NCCL refuses two ranks on one GPU: same-GPU servers use IPC or TCP.
        if (ipc) return Plane::kCudaIpc;
        return nccl && !IpcReachable(server, device) ? Plane::kNccl : Plane::kTcp;
      case DevicePlane::kCudaIpc:
        return ipc ? Plane::kCudaIpc : Plane::kTcp;
      case DevicePlane::kNccl:
        return nccl ? Plane::kNccl : Plane::kTcp;
      case DevicePlane::kTcp:
        return Plane::kTcp;
    }
    return Plane::kTcp;
  }

  // A new NCCL link with server i on `device`: the OpenNcclChannel RPC, then the join.
  absl::StatusOr<std::shared_ptr<client_internal::NcclLink>> OpenLink(int server, int device) {
    auto open_channel = [&](const std::string& unique_id) -> absl::StatusOr<uint64_t> {
      v1::OpenNcclChannelRequest request;
      request.set_unique_id(unique_id);
      request.set_worker_rank(options_.worker_rank);
      v1::OpenNcclChannelResponse response;
      FLATSHARD_RETURN_IF_ERROR(Call(server, &v1::Flatshard::Stub::OpenNcclChannel, request, &response));
      return response.channel();
    };
    FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<client_internal::NcclLink> link,
                               client_internal::NcclLink::Open(device, options_.timeout, open_channel));
    return std::shared_ptr<client_internal::NcclLink>(std::move(link));
  }

  // One NCCL transfer with server i on its data connection `conn`: the request, the
  // server's ready answer, the bytes, its done answer. Returns the done answer (or why
  // there is none) and whether `conn` is still usable.
  std::pair<absl::StatusOr<int64_t>, bool> NcclTransfer(int server, transport::Connection& conn,
                                                        transport::DataOp op, const std::string& group,
                                                        int64_t version, DType dtype,
                                                        absl::Span<std::byte> part, int device) {
    const bool gather = op == transport::DataOp::kGather;
    for (int attempt = 0;; ++attempt) {
      // This transfer's own link: others with this server run beside it on theirs.
      absl::StatusOr<NcclLinks::Lease> lease = nccl_links_[server]->Acquire(device);
      if (!lease.ok()) return {lease.status(), true};
      client_internal::NcclLink& link = **lease;
      transport::RequestHeader header;
      header.op = static_cast<uint8_t>(gather ? transport::DataOp::kNcclGather
                                              : transport::DataOp::kNcclScatter);
      header.dtype = static_cast<uint8_t>(dtype);
      header.worker_rank = options_.worker_rank;
      header.version = version;
      header.timeout_ms = absl::ToInt64Milliseconds(options_.timeout);
      const transport::NcclTarget target{link.channel(), part.size()};
      absl::Status sent = transport::SendRequest(
          conn, header, options_.job, group,
          absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), sizeof(target)));
      if (!sent.ok()) return {sent, false};
      absl::StatusOr<transport::Response> ready = transport::RecvResponse(conn, {});
      if (!ready.ok()) return {ready.status(), false};
      if (absl::IsNotFound(ready->status) && attempt == 0) {
        lease->Drop();  // the server closed the channel after a failure: reopen
        continue;
      }
      if (!ready->status.ok()) return {ready->status, true};
      absl::Status moved = gather ? link.Recv(part.data(), part.size(), options_.timeout)
                                  : link.Send(part.data(), part.size(), options_.timeout);
      if (!moved.ok()) return {moved, false};  // the server answers done with its own error
      absl::StatusOr<transport::Response> done = transport::RecvResponse(conn, {});
      if (!done.ok()) return {done.status(), false};
      if (!done->status.ok()) return {done->status, true};
      return {done->version, true};
    }
  }

  // Gather into / scatter from a device buffer (`parts` are its per-server slices), each
  // server over the plane PlaneFor picks: CUDA IPC and NCCL move the bytes GPU to GPU,
  // TCP through host copies. Without TCP servers the requests go straight to the data
  // channels (no thread of its own, no copies).
  template <typename Result>
  std::future<Result> DeviceTransfer(transport::DataOp op, const std::string& group,
                                     int64_t version, DType dtype, const void* buffer,
                                     std::vector<absl::Span<std::byte>> parts, int device) {
    absl::StatusOr<client_internal::IpcExport> exported = client_internal::ExportForIpc(buffer);
    std::vector<int> ipc_servers, nccl_servers, tcp_servers;
    for (int i = 0; i < num_servers(); ++i) {
      switch (PlaneFor(i, device, exported.ok())) {
        case Plane::kCudaIpc: ipc_servers.push_back(i); break;
        case Plane::kNccl: nccl_servers.push_back(i); break;
        case Plane::kTcp: tcp_servers.push_back(i); break;
      }
    }
    auto targets = std::make_shared<std::vector<transport::IpcTarget>>(num_servers());
    std::vector<absl::Span<const std::byte>> target_bytes(num_servers());
    for (int i : ipc_servers) {
      transport::IpcTarget& target = (*targets)[i];
      std::memcpy(target.handle, exported->handle.data(),
                  std::min(exported->handle.size(), sizeof(target.handle)));
      target.offset = exported->offset + static_cast<uint64_t>(parts[i].data() - parts[0].data());
      target.bytes = parts[i].size();
      target_bytes[i] = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), sizeof(target));
    }
    const transport::DataOp ipc_op =
        op == transport::DataOp::kGather ? transport::DataOp::kIpcGather : transport::DataOp::kIpcScatter;
    // The GPU-to-GPU planes' requests, under one completion.
    auto submit_gpu = [=, this](auto completion) {
      // The IPC targets must outlive the requests, which the completion ends.
      Submit(completion, ipc_op, group, version, dtype, target_bytes, {}, ipc_servers, targets);
      SubmitNccl(completion, op, group, version, dtype, parts, nccl_servers, device);
    };
    const size_t gpu_servers = ipc_servers.size() + nccl_servers.size();
    if (tcp_servers.empty()) {
      auto completion = std::make_shared<Completion<Result>>(static_cast<int>(gpu_servers));
      submit_gpu(completion);
      return completion->future();
    }
    return std::async(std::launch::async, [=, this, parts = std::move(parts)]() -> Result {
      std::future<absl::StatusOr<int64_t>> gpu;
      if (gpu_servers > 0) {
        auto completion = std::make_shared<Completion<absl::StatusOr<int64_t>>>(static_cast<int>(gpu_servers));
        gpu = completion->future();
        submit_gpu(completion);
      }
      absl::StatusOr<int64_t> result = StagedTransfer(op, group, version, dtype, parts, tcp_servers);
      if (gpu.valid()) {
        absl::StatusOr<int64_t> gpu_result = gpu.get();
        if (!gpu_result.ok()) {
          result = gpu_result.status();
        } else if (result.ok()) {
          result = std::min(*result, *gpu_result);
        }
      }
      if constexpr (std::is_same_v<Result, absl::Status>) {
        return result.status();
      } else {
        return result;
      }
    });
  }

  // NCCL transfers with `servers`, each on its data channel, finishing `completion`.
  template <typename Result>
  void SubmitNccl(const std::shared_ptr<Completion<Result>>& completion, transport::DataOp op,
                  const std::string& group, int64_t version, DType dtype,
                  const std::vector<absl::Span<std::byte>>& parts, const std::vector<int>& servers,
                  int device) {
    for (int i : servers) {
      const std::string server = options_.servers[i];
      const absl::Span<std::byte> part = parts[i];
      channels_[i]->Submit([=, this](absl::StatusOr<transport::Connection*> conn) {
        if (!conn.ok()) {
          completion->Finish(AtServer(server, conn.status()), 0);
          return true;
        }
        auto [result, usable] = NcclTransfer(i, **conn, op, group, version, dtype, part, device);
        completion->Finish(result.ok() ? absl::OkStatus() : AtServer(server, result.status()),
                           result.value_or(0));
        return usable;
      });
    }
  }

  static absl::Status AtServer(const std::string& server, const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat("server ", server, ": ", status.message()));
  }

  // The TCP data plane for device buffers: through host copies of the slices of `servers`.
  absl::StatusOr<int64_t> StagedTransfer(transport::DataOp op, const std::string& group,
                                         int64_t version, DType dtype,
                                         const std::vector<absl::Span<std::byte>>& parts,
                                         const std::vector<int>& servers) {
    const bool gather = op == transport::DataOp::kGather;
    std::vector<std::vector<std::byte>> staging(num_servers());
    std::vector<absl::Span<const std::byte>> sends(num_servers());
    std::vector<absl::Span<std::byte>> receives(num_servers());
    for (int i : servers) {
      staging[i].resize(parts[i].size());
      if (!gather) {
        FLATSHARD_RETURN_IF_ERROR(
            client_internal::CopyToHost(staging[i].data(), parts[i].data(), parts[i].size()));
      }
      sends[i] = staging[i];
      receives[i] = absl::MakeSpan(staging[i]);
    }
    FLATSHARD_ASSIGN_OR_RETURN(
        int64_t min_version,
        Transfer<absl::StatusOr<int64_t>>(op, group, version, dtype,
                                          gather ? std::vector<absl::Span<const std::byte>>{} : sends,
                                          gather ? receives : std::vector<absl::Span<std::byte>>{},
                                          servers)
            .get());
    if (gather) {
      for (int i : servers) {
        FLATSHARD_RETURN_IF_ERROR(
            client_internal::CopyToDevice(parts[i].data(), staging[i].data(), staging[i].size()));
      }
    }
    return min_version;
  }

  // How many ranges a gather of `bytes` from one server comes in: one below
  // gather_split_bytes, else up to max_in_flight of at least half that size each.
  int64_t GatherRanges(size_t bytes) const {
    const int64_t split = options_.gather_split_bytes;
    if (split <= 0 || options_.max_in_flight < 2 || static_cast<int64_t>(bytes) < split) return 1;
    return std::clamp<int64_t>(static_cast<int64_t>(bytes) / std::max<int64_t>(1, split / 2), 1,
                               options_.max_in_flight);
  }

  // A gather into host memory. A server's part of gather_split_bytes or more comes in
  // ranges over several of its connections at once; if the group stepped between them
  // (that server's ranges saw different versions), that part is gathered again whole.
  // As for any gather, different servers' parts may hold different versions (async jobs);
  // the result is the lowest.
  std::future<absl::StatusOr<int64_t>> HostGather(const std::string& group, int64_t min_version,
                                                  DType dtype, std::vector<absl::Span<std::byte>> parts) {
    using Result = absl::StatusOr<int64_t>;
    const bool split = std::any_of(parts.begin(), parts.end(), [&](absl::Span<std::byte> part) {
      return GatherRanges(part.size()) > 1;
    });
    if (!split) return Transfer<Result>(transport::DataOp::kGather, group, min_version, dtype, {}, parts);
    std::vector<std::future<Result>> per_server;
    for (int i = 0; i < num_servers(); ++i) {
      const int64_t count = GatherRanges(parts[i].size());
      auto completion =
          std::make_shared<Completion<Result>>(static_cast<int>(count), /*same_version=*/count > 1);
      per_server.push_back(completion->future());
      if (count == 1) {
        SubmitOne(completion, i, transport::DataOp::kGather, group, min_version, dtype, {}, parts[i],
                  nullptr);
        continue;
      }
      // Range boundaries on 64 bytes: whole elements of every dtype.
      const uint64_t bytes = parts[i].size();
      const uint64_t step = (bytes / count + 63) / 64 * 64;
      auto ranges = std::make_shared<std::vector<transport::GatherRange>>();
      for (uint64_t offset = 0; offset < bytes; offset += step) {
        ranges->push_back({offset, std::min(step, bytes - offset)});
      }
      for (const transport::GatherRange& range : *ranges) {
        SubmitOne(completion, i, transport::DataOp::kGatherRange, group, min_version, dtype,
                  absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&range), sizeof(range)),
                  parts[i].subspan(range.offset, range.bytes), ranges);
      }
    }
    return std::async(std::launch::async, [this, group, min_version, dtype, parts = std::move(parts),
                                           per_server = std::move(per_server)]() mutable -> Result {
      Result combined = std::numeric_limits<int64_t>::max();
      // Every part is waited for, even after an error: its requests write into `parts`.
      for (int i = 0; i < num_servers(); ++i) {
        Result part = per_server[i].get();
        if (!part.ok() && part.status().message() == kTornGather) {
          part = Transfer<Result>(transport::DataOp::kGather, group, min_version, dtype, {}, parts, {i})
                     .get();
        }
        if (!part.ok()) {
          if (combined.ok()) combined = part.status();
        } else if (combined.ok()) {
          combined = std::min(*combined, *part);
        }
      }
      return combined;
    });
  }

  // One request per server in `servers` (all when empty) on its data channel:
  // `sends[i]` is server i's payload, or `receives[i]` its response payload's destination.
  template <typename Result>
  std::future<Result> Transfer(transport::DataOp op, const std::string& group, int64_t version,
                               DType dtype, std::vector<absl::Span<const std::byte>> sends,
                               std::vector<absl::Span<std::byte>> receives,
                               std::vector<int> servers = {}) {
    if (servers.empty()) {
      for (int i = 0; i < num_servers(); ++i) servers.push_back(i);
    }
    auto completion = std::make_shared<Completion<Result>>(static_cast<int>(servers.size()));
    Submit(completion, op, group, version, dtype, sends, receives, servers, nullptr);
    return completion->future();
  }

  // Transfer's requests, finishing `completion`; `keep_alive` is held until each has
  // finished (what `sends` points into).
  template <typename Result>
  void Submit(const std::shared_ptr<Completion<Result>>& completion, transport::DataOp op,
              const std::string& group, int64_t version, DType dtype,
              const std::vector<absl::Span<const std::byte>>& sends,
              const std::vector<absl::Span<std::byte>>& receives, const std::vector<int>& servers,
              std::shared_ptr<const void> keep_alive) {
    for (int i : servers) {
      SubmitOne(completion, i, op, group, version, dtype,
                sends.empty() ? absl::Span<const std::byte>() : sends[i],
                receives.empty() ? absl::Span<std::byte>() : receives[i], keep_alive);
    }
  }

  // One request to server i: `send` is its payload, `receive` its response payload's
  // destination; it finishes `completion`, and `keep_alive` is held until then.
  template <typename Result>
  void SubmitOne(const std::shared_ptr<Completion<Result>>& completion, int i, transport::DataOp op,
                 const std::string& group, int64_t version, DType dtype,
                 absl::Span<const std::byte> send, absl::Span<std::byte> receive,
                 std::shared_ptr<const void> keep_alive) {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(op);
    header.dtype = static_cast<uint8_t>(dtype);
    header.worker_rank = options_.worker_rank;
    header.version = version;
    header.timeout_ms = absl::ToInt64Milliseconds(options_.timeout);
    const std::string server = options_.servers[i];
    channels_[i]->Submit([=, this, hold = keep_alive](absl::StatusOr<transport::Connection*> conn) {
      (void)hold;
      auto fail = [&](const absl::Status& status) { completion->Finish(AtServer(server, status), 0); };
      if (!conn.ok()) {
        fail(conn.status());
        return true;
      }
      absl::Status sent = transport::SendRequest(**conn, header, options_.job, group, send);
      if (!sent.ok()) {
        fail(sent);
        return false;
      }
      absl::StatusOr<transport::Response> response = transport::RecvResponse(**conn, receive);
      if (!response.ok()) {
        fail(response.status());
        return false;
      }
      if (!response->status.ok()) {
        fail(response->status);
      } else {
        completion->Finish(absl::OkStatus(), response->version);
      }
      return true;
    });
  }

  const ClientOptions options_;
  std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs_;
  std::vector<std::unique_ptr<DataChannel>> channels_;
  std::vector<std::string> server_gpus_;  // ClusterInfo.gpu_uuid per server
  std::vector<bool> server_nccl_;         // ClusterInfo.nccl_version is set, per server
  bool nccl_loads_ = false;               // NCCL loads in this process
  using NcclLinks = client_internal::LinkPool<client_internal::NcclLink>;
  std::vector<std::unique_ptr<NcclLinks>> nccl_links_;  // per server
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FlatLayout>> layouts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  auto client = std::make_unique<ClientImpl>(std::move(options));
  FLATSHARD_RETURN_IF_ERROR(client->Init());
  return client;
}

}  // namespace flatshard
