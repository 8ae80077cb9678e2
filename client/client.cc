#include "flatshard/client.h"

#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/checkpoint_calls.h"
#include "client/completion.h"
#include "client/control_channel.h"
#include "client/control_plane.h"
#include "client/data_transfers.h"
#include "client/sent_steps.h"
#include "client/wait_hook.h"
#include "core/status_macros.h"
#include "proto/cluster_info.h"
#include "proto/convert.h"
#include "proto/flatshard.grpc.pb.h"
#include "proto/keepalive.h"

namespace flatshard {
namespace {

using client_internal::ReadyFuture;

v1::OptimizerSettings OptimizerToProto(const OptimizerOptions& optimizer) {
  v1::OptimizerSettings proto;
  if (const auto* sgd = std::get_if<SgdOptions>(&optimizer)) {
    v1::SgdSettings* out = proto.mutable_sgd();
    out->set_lr(sgd->lr);
    out->set_momentum(sgd->momentum);
    out->set_dampening(sgd->dampening);
    out->set_weight_decay(sgd->weight_decay);
    out->set_nesterov(sgd->nesterov);
  } else if (std::holds_alternative<FrozenOptions>(optimizer)) {
    proto.mutable_frozen();
  } else if (std::holds_alternative<AverageOptions>(optimizer)) {
    proto.mutable_average();
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

// "group 'g'", or "3 groups ('a', 'b', 'c')", "1000 groups ('a', 'b', 'c', ...)": what a
// wait for `groups` names in its errors.
std::string GroupsNamed(const std::vector<std::string>& groups) {
  if (groups.size() == 1) return absl::StrCat("group '", groups[0], "'");
  constexpr size_t kNamed = 3;
  std::string named;
  for (size_t i = 0; i < std::min(groups.size(), kNamed); ++i) absl::StrAppend(&named, i ? ", '" : "'", groups[i], "'");
  return absl::StrCat(groups.size(), " groups (", named, groups.size() > kNamed ? ", ...)" : ")");
}

// Data connections (and NCCL links) per server: beyond this, threads and sockets are
// wasted and a mistyped option would exhaust the servers' descriptors.
constexpr int kMaxInFlight = 64;
// The most bytes of group specs one RegisterGroup call carries (one spec may exceed it).
constexpr size_t kRegisterCallBytes = size_t{1} << 20;

// The Client: checks options, learns the cluster at Connect, keeps the layouts of the
// groups it registered, and hands control calls to ControlPlane, checkpoints to
// CheckpointCalls and bytes to DataTransfers.
class ClientImpl final : public Client {
 public:
  explicit ClientImpl(ClientOptions options) : options_(std::move(options)), sent_(options_.worker_rank) {}

  absl::Status Init() {
    FLATSHARD_RETURN_IF_ERROR(CheckOptions(options_));
    FLATSHARD_ASSIGN_OR_RETURN(control_, client_internal::ControlPlane::Create(options_));
    std::vector<client_internal::ServerEndpoint> endpoints;
    for (int i = 0; i < num_servers(); ++i) {
      FLATSHARD_ASSIGN_OR_RETURN(client_internal::ServerEndpoint endpoint, Handshake(i));
      endpoints.push_back(std::move(endpoint));
    }
    checkpoints_ = std::make_unique<client_internal::CheckpointCalls>(*control_, options_.job,
                                                                      options_.export_chunk_bytes);
    transfers_ = std::make_unique<client_internal::DataTransfers>(
        options_, std::move(endpoints),
        client_internal::ControlCalls{
            .open_nccl_channel = [this](int server, const std::string& unique_id,
                                        std::stop_token stop) { return OpenNcclChannel(server, unique_id, stop); },
            .open_session = [this](int server, std::stop_token stop) { return OpenSession(server, stop); },
        });
    return absl::OkStatus();
  }

  const ClientOptions& options() const override { return options_; }

  absl::Status ConfigureJob(const JobOptions& job, std::stop_token stop) override {
    v1::ConfigureJobRequest request;
    request.set_job(options_.job);
    v1::JobSettings* settings = request.mutable_settings();
    settings->set_num_workers(options_.num_workers);
    settings->set_reduce(job.reduce_mean ? v1::JobSettings::MEAN : v1::JobSettings::SUM);
    settings->set_max_grad_norm(job.max_grad_norm);
    settings->set_norm_type(job.norm_type);
    settings->set_mode(job.async ? v1::JobSettings::ASYNC : v1::JobSettings::SYNC);
    if (job.max_staleness >= 0) settings->set_max_staleness(job.max_staleness);
    settings->set_replicas(job.replicas);
    settings->set_skip_nonfinite(job.skip_nonfinite);
    v1::ConfigureJobResponse response;
    return control_->CallAll(&v1::Flatshard::Stub::PrepareAsyncConfigureJob, request, &response, stop);
  }

  absl::StatusOr<int64_t> DeleteJob(std::stop_token stop) override {
    transfers_->scatter_answers().Forget();  // a job made again starts over
    v1::DeleteJobRequest request;
    request.set_job(options_.job);
    int64_t freed = 0;
    bool deleted = false;
    for (int i = 0; i < num_servers(); ++i) {
      v1::DeleteJobResponse response;
      FLATSHARD_RETURN_IF_ERROR(control_->Call(i, &v1::Flatshard::Stub::PrepareAsyncDeleteJob, request, &response,
                                               absl::ZeroDuration(), nullptr, stop));
      deleted |= response.deleted();
      freed += response.freed_bytes();
    }
    if (!deleted) return absl::NotFoundError(absl::StrCat("job '", options_.job, "' is configured on no server"));
    return freed;
  }

  absl::StatusOr<std::vector<const FlatLayout*>> RegisterGroups(std::vector<GroupSpec> groups,
                                                                std::stop_token stop) override {
    if (groups.empty()) return absl::InvalidArgumentError("RegisterGroups: no group");
    std::vector<const FlatLayout*> layouts;
    layouts.reserve(groups.size());
    for (size_t first = 0, next = 0; first < groups.size(); first = next) {
      // A call carries specs up to kRegisterCallBytes (far below the servers' 16 MiB
      // message limit): a model of 20000 small groups takes a few calls.
      v1::RegisterGroupRequest request;
      request.set_job(options_.job);
      for (size_t bytes = 0; next < groups.size() && (next == first || bytes < kRegisterCallBytes); ++next) {
        v1::GroupSpec& spec = *request.add_groups();
        spec.set_group(groups[next].group);
        ToProto(groups[next].tensors, spec.mutable_tensors());
        spec.set_align(groups[next].align);
        *spec.mutable_optimizer() = OptimizerToProto(groups[next].optimizer);
        bytes += spec.ByteSizeLong();
      }
      v1::RegisterGroupResponse response;
      FLATSHARD_RETURN_IF_ERROR(
          control_->CallServerZeroThenOthers(&v1::Flatshard::Stub::PrepareAsyncRegisterGroup, request, &response,
                                             control_->model_timeout(), stop));
      if (static_cast<size_t>(response.groups_size()) != next - first) {
        return absl::InternalError(absl::StrCat("server ", control_->address(0), " answered for ",
                                                response.groups_size(), " groups of ", next - first));
      }
      // The layouts are over one replica group (the servers know the job's replica groups).
      const int replicas = std::max(1, response.replicas());
      for (size_t i = first; i < next; ++i) {
        FLATSHARD_ASSIGN_OR_RETURN(
            const FlatLayout* layout,
            Registered(std::move(groups[i]), response.groups(static_cast<int>(i - first)), replicas));
        layouts.push_back(layout);
      }
    }
    return layouts;
  }

  absl::Status InitGroups(const std::vector<GroupValues>& groups, std::stop_token stop) override {
    std::vector<client_internal::DataTransfers::GroupInit> inits;
    inits.reserve(groups.size());
    for (const GroupValues& values : groups) {
      FLATSHARD_ASSIGN_OR_RETURN(const FlatLayout* layout, FindLayout(values.group));
      const absl::Span<const float> flat = values.flat;
      const bool padded = static_cast<int64_t>(flat.size()) == layout->padded_numel();
      if (!padded && static_cast<int64_t>(flat.size()) != layout->unpadded_numel()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "initial values for group '", values.group, "': ", flat.size(), " elements, expected ",
            layout->unpadded_numel(), " (or padded ", layout->padded_numel(), ")"));
      }
      // Each server gets its shard straight from `flat` (every replica group its copy);
      // what an unpadded `flat` lacks of a shard goes as zeros.
      inits.push_back({values.group, std::vector<client_internal::InitShard>(num_servers())});
      std::vector<client_internal::InitShard>& shards = inits.back().shards;
      for (int rank = 0; rank < num_servers(); ++rank) {
        const int shard = rank % layout->num_shards();
        const int64_t held = padded ? layout->shard_numel() : layout->shard_end(shard) - layout->shard_start(shard);
        const float* start = flat.data() + std::min<int64_t>(layout->shard_start(shard), flat.size());
        shards[rank] = {absl::MakeConstSpan(reinterpret_cast<const std::byte*>(start), held * sizeof(float)),
                        (layout->shard_numel() - held) * sizeof(float)};
      }
    }
    return transfers_->PushInits(inits, std::move(stop));
  }

  absl::Status InitGroupFromSeed(const std::string& group, uint64_t seed, std::stop_token stop) override {
    v1::InitGroupRequest request;
    request.set_job(options_.job);
    request.set_group(group);
    request.set_seed(seed);
    v1::InitGroupResponse response;
    return control_->CallServerZeroThenOthers(&v1::Flatshard::Stub::PrepareAsyncInitGroup, request, &response,
                                              control_->model_timeout(), stop);
  }

  std::future<absl::StatusOr<int64_t>> Gather(const std::string& group, int64_t min_version, DType dtype,
                                              absl::Span<std::byte> out, std::stop_token stop) override {
    absl::StatusOr<std::vector<absl::Span<std::byte>>> parts = Split(group, dtype, out);
    if (!parts.ok()) return ReadyFuture<absl::StatusOr<int64_t>>(parts.status());
    return transfers_->Gather(group, min_version, dtype, *std::move(parts), ReplicaServers(), std::move(stop));
  }

  std::future<absl::Status> Scatter(const std::string& group, int64_t step, DType dtype,
                                    absl::Span<const std::byte> grad, std::stop_token stop) override {
    absl::StatusOr<std::vector<absl::Span<std::byte>>> parts =
        Split(group, dtype, absl::MakeSpan(const_cast<std::byte*>(grad.data()), grad.size()));
    if (!parts.ok()) return ReadyFuture<absl::Status>(parts.status());
    sent_.Record(group, step);
    return transfers_->Scatter(group, step, dtype, *std::move(parts), ReplicaServers(), std::move(stop));
  }

  std::vector<std::future<absl::StatusOr<int64_t>>> GatherGroups(const std::vector<std::string>& groups,
                                                                  int64_t min_version, DType dtype,
                                                                  const std::vector<absl::Span<std::byte>>& outs,
                                                                  std::stop_token stop) override {
    return ForEachGroup<absl::StatusOr<int64_t>>(
        groups, dtype, outs, [&](const std::vector<client_internal::DataTransfers::GroupParts>& split) {
          return transfers_->GatherMany(split, min_version, dtype, ReplicaServers(), stop);
        });
  }

  std::vector<std::future<absl::Status>> ScatterGroups(const std::vector<std::string>& groups, int64_t step,
                                                       DType dtype, const std::vector<absl::Span<const std::byte>>& grads,
                                                       std::stop_token stop) override {
    std::vector<absl::Span<std::byte>> buffers;
    buffers.reserve(grads.size());
    for (const absl::Span<const std::byte> grad : grads) {
      buffers.push_back(absl::MakeSpan(const_cast<std::byte*>(grad.data()), grad.size()));
    }
    return ForEachGroup<absl::Status>(
        groups, dtype, buffers, [&](const std::vector<client_internal::DataTransfers::GroupParts>& split) {
          for (const client_internal::DataTransfers::GroupParts& group : split) sent_.Record(group.group, step);
          return transfers_->ScatterMany(split, step, dtype, ReplicaServers(), stop);
        });
  }

  std::vector<std::string> DataPlanes() const override { return transfers_->PlaneNames(); }

  absl::StatusOr<int64_t> WaitVersion(const std::string& group, int64_t min_version, std::stop_token stop) override {
    FLATSHARD_ASSIGN_OR_RETURN(const std::vector<int64_t> versions,
                               WaitVersions({group}, min_version, std::move(stop)));
    return versions[0];
  }

  absl::StatusOr<std::vector<int64_t>> WaitVersions(const std::vector<std::string>& groups, int64_t min_version,
                                                    std::stop_token stop) override {
    if (groups.empty()) return absl::InvalidArgumentError("WaitVersions names no group");
    // This client's gradients for the step before made every server answer min_version:
    // they are there (ScatterAnswers), as a wait would find.
    if (transfers_->scatter_answers().Reached(groups, min_version)) {
      return std::vector<int64_t>(groups.size(), min_version);
    }
    v1::WaitVersionRequest request;
    request.set_job(options_.job);
    request.mutable_groups()->Add(groups.begin(), groups.end());
    request.set_min_version(min_version);
    // Every server of the replica group at once: one round trip, and the longest wait.
    const std::vector<int> servers = ReplicaServers();
    std::vector<v1::WaitVersionResponse> responses;
    const absl::Status waited =
        control_->CallEach(servers, &v1::Flatshard::Stub::PrepareAsyncWaitVersion, request, responses, stop);
    if (!waited.ok() && stop.stop_requested()) {
      return absl::CancelledError(
          absl::StrCat("the wait for version ", min_version, " of ", GroupsNamed(groups), " was stopped"));
    }
    FLATSHARD_RETURN_IF_ERROR(waited);
    std::vector<int64_t> versions(groups.size(), std::numeric_limits<int64_t>::max());
    for (size_t k = 0; k < servers.size(); ++k) {
      const v1::WaitVersionResponse& response = responses[k];
      if (response.versions_size() != static_cast<int>(groups.size())) {
        return absl::InternalError(absl::StrCat("server ", options_.servers[servers[k]], " answered ",
                                                response.versions_size(), " versions for ", groups.size(), " groups"));
      }
      for (size_t g = 0; g < groups.size(); ++g) versions[g] = std::min(versions[g], response.versions(g));
    }
    return versions;
  }

  absl::StatusOr<double> GradNorm(int64_t step, std::stop_token stop) override {
    v1::GetGradNormRequest request;
    request.set_job(options_.job);
    request.set_step(step);
    v1::GetGradNormResponse response;
    // Every server combined the same norm; server 0 is in every job's replica group 0.
    const absl::Status got = control_->Call(0, &v1::Flatshard::Stub::PrepareAsyncGetGradNorm, request, &response,
                                            absl::ZeroDuration(), nullptr, stop);
    if (!got.ok() && stop.stop_requested()) {
      return absl::CancelledError(absl::StrCat("the wait for the gradient norm of step ", step, " was stopped"));
    }
    FLATSHARD_RETURN_IF_ERROR(got);
    return response.norm();
  }

  absl::Status SaveCheckpoint(const std::string& name, CheckpointKind kind, bool optimizer, bool async,
                              Progress progress, CutAt at) override {
    return checkpoints_->Save(name, kind, optimizer, async, sent_, at, progress);
  }

  absl::Status LoadCheckpoint(const std::string& name, Progress progress) override {
    return Load(name, /*non_strict=*/false, std::move(progress)).status();
  }

  absl::StatusOr<IncompatibleTensors> LoadCheckpointNonStrict(const std::string& name, Progress progress) override {
    return Load(name, /*non_strict=*/true, std::move(progress));
  }

  absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(std::stop_token stop) override {
    return checkpoints_->List(stop);
  }

  absl::Status DeleteCheckpoint(const std::string& name, std::stop_token stop) override {
    return checkpoints_->Delete(name, stop);
  }

  absl::Status ExportStateDict(const std::string& out_dir, CheckpointKind kind, bool optimizer, Progress progress,
                               CutAt at) override {
    return checkpoints_->Export(out_dir, kind, optimizer, sent_, at, progress);
  }

  absl::StatusOr<ImportedCheckpoint> ImportCheckpoint(const std::string& name, const std::string& in_dir,
                                                      bool optimizer, int64_t version, Progress progress) override {
    return checkpoints_->Import(name, in_dir, optimizer, version, progress);
  }

  void CancelCheckpointCalls() override { checkpoints_->CancelAll(); }

  using Client::SetHyperparams;
  absl::Status SetHyperparams(const std::vector<GroupOptimizer>& groups, std::stop_token stop) override {
    if (groups.empty()) return absl::InvalidArgumentError("SetHyperparams names no group");
    // On the data plane (kSetHyperparams): a learning-rate schedule makes this call every
    // step, and a warm connection's round trip is a fraction of a gRPC call's.
    v1::SetHyperparamsRequest request;  // the data request names the job
    for (const GroupOptimizer& group : groups) {
      v1::GroupOptimizer* entry = request.add_groups();
      entry->set_group(group.group);
      *entry->mutable_optimizer() = OptimizerToProto(group.optimizer);
    }
    const auto settings = std::make_shared<const std::string>(request.SerializeAsString());
    auto answer = [&](int server, std::future<absl::Status>& answered) {
      const absl::Status status = client_internal::AwaitCallingWaitHook(answered);
      return !status.ok() && stop.stop_requested() ? control_->Stopped(server) : status;
    };
    // Server 0 first: a refusal (every server checks alike) or a stop while server 0 does
    // not answer changes no server; then the others at once.
    std::future<absl::Status> first = transfers_->SetHyperparams(0, settings, stop);
    FLATSHARD_RETURN_IF_ERROR(answer(0, first));
    std::vector<std::future<absl::Status>> others;
    for (int i = 1; i < num_servers(); ++i) others.push_back(transfers_->SetHyperparams(i, settings, stop));
    absl::Status status;
    for (int i = 1; i < num_servers(); ++i) status.Update(answer(i, others[i - 1]));
    return status;
  }

 private:
  // Both loads: the servers may have moved even if it failed, so this client's record of
  // the steps it sent and their answers goes.
  absl::StatusOr<IncompatibleTensors> Load(const std::string& name, bool non_strict, Progress progress) {
    absl::StatusOr<IncompatibleTensors> loaded = checkpoints_->Load(name, non_strict, progress);
    transfers_->scatter_answers().Forget();
    if (loaded.ok()) sent_.Forget();
    return loaded;
  }

  static absl::Status CheckOptions(const ClientOptions& options) {
    if (options.servers.empty()) return absl::InvalidArgumentError("servers: empty list");
    if (options.num_workers < 1 || options.worker_rank < 0 ||
        options.worker_rank >= options.num_workers) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker_rank ", options.worker_rank,
                       " outside [0, num_workers=", options.num_workers, ")"));
    }
    if (options.max_in_flight < 1 || options.max_in_flight > kMaxInFlight) {
      return absl::InvalidArgumentError(absl::StrCat("max_in_flight ", options.max_in_flight,
                                                     " outside [1, ", kMaxInFlight, "]"));
    }
    if (options.timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("timeout ", absl::FormatDuration(options.timeout), " is not positive"));
    }
    if (options.model_timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model_timeout ", absl::FormatDuration(options.model_timeout), " is not positive"));
    }
    if (options.keepalive < kMinKeepaliveInterval) {
      return absl::InvalidArgumentError(absl::StrCat("keepalive ", absl::FormatDuration(options.keepalive),
                                                     " is below ", absl::FormatDuration(kMinKeepaliveInterval),
                                                     " (servers take pings at most once a second)"));
    }
    if (options.gather_split_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather_split_bytes ", options.gather_split_bytes, " is negative"));
    }
    if (options.scatter_split_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("scatter_split_bytes ", options.scatter_split_bytes, " is negative"));
    }
    if (options.tls_reload_interval < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tls_reload_interval ", absl::FormatDuration(options.tls_reload_interval), " is negative"));
    }
    return absl::OkStatus();
  }

  // Checks that server i believes in the same cluster (same address list, its rank = i)
  // and opens this worker's data session with it.
  absl::StatusOr<client_internal::ServerEndpoint> Handshake(int i) {
    const std::string& address = options_.servers[i];
    v1::ClusterInfo info;
    FLATSHARD_RETURN_IF_ERROR(client_internal::WithUnreachableHint(
        control_->Call(i, &v1::Flatshard::Stub::PrepareAsyncGetClusterInfo, v1::GetClusterInfoRequest(), &info),
        options_));
    FLATSHARD_RETURN_IF_ERROR(CheckClusterInfo(info, options_.servers, i, "this client"));
    FLATSHARD_ASSIGN_OR_RETURN(client_internal::DataSession session, OpenSession(i));
    return client_internal::ServerEndpoint{
        .address = address,
        .session = std::move(session),
        .gpu_uuid = info.gpu_uuid(),
        .nccl = !info.nccl_version().empty(),
    };
  }

  // This worker's data-plane session with server i: where to connect, what to present.
  absl::StatusOr<client_internal::DataSession> OpenSession(int server, std::stop_token stop = {}) {
    v1::OpenSessionRequest request;
    request.set_worker_rank(options_.worker_rank);
    v1::OpenSessionResponse response;
    FLATSHARD_RETURN_IF_ERROR(control_->Call(server, &v1::Flatshard::Stub::PrepareAsyncOpenSession, request, &response,
                                             absl::ZeroDuration(), nullptr, stop));
    if (response.data_tls() && !control_->data_tls()) {  // only a TLS control plane offers it
      return absl::FailedPreconditionError(absl::StrCat("server ", options_.servers[server],
                                                        ": its data plane speaks TLS; set tls_ca_file"));
    }
    return client_internal::DataSession{response.data_address(), response.session_token(),
                                        response.data_tls() ? control_->data_tls() : transport::SecureLayer()};
  }

  absl::StatusOr<uint64_t> OpenNcclChannel(int server, const std::string& unique_id, std::stop_token stop) {
    v1::OpenNcclChannelRequest request;
    request.set_unique_id(unique_id);
    request.set_worker_rank(options_.worker_rank);
    v1::OpenNcclChannelResponse response;
    FLATSHARD_RETURN_IF_ERROR(
        control_->Call(server, &v1::Flatshard::Stub::PrepareAsyncOpenNcclChannel, request, &response,
                       absl::ZeroDuration(), nullptr, std::move(stop)));
    return response.channel();
  }

  // The layout of `spec` as the servers registered it (`registered`, over N / replicas
  // shards), kept for the Client's lifetime; Internal if the servers' shards differ
  // from it.
  absl::StatusOr<const FlatLayout*> Registered(GroupSpec spec, const v1::RegisteredGroup& registered, int replicas) {
    FLATSHARD_ASSIGN_OR_RETURN(FlatLayout layout,
                               FlatLayout::Create(std::move(spec.tensors), spec.align, num_servers() / replicas));
    if (layout.shard_numel() != registered.shard_numel()) {
      return absl::InternalError(absl::StrCat("group '", spec.group, "': the servers hold shards of ",
                                              registered.shard_numel(), " elements; this client computed ",
                                              layout.shard_numel()));
    }
    if (!std::holds_alternative<FrozenOptions>(spec.optimizer)) sent_.Register(spec.group);
    absl::MutexLock lock(&mu_);
    replicas_ = replicas;
    auto& slot = layouts_[spec.group];
    if (slot == nullptr || !(*slot == layout)) slot = std::make_unique<FlatLayout>(std::move(layout));
    return slot.get();
  }

  absl::StatusOr<const FlatLayout*> FindLayout(const std::string& group) {
    absl::MutexLock lock(&mu_);
    const auto it = layouts_.find(group);
    if (it == layouts_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "group '", group, "' was not registered by this client; call RegisterGroup"));
    }
    return it->second.get();
  }

  // The servers of this worker's replica group, in rank order: all of them unless the
  // job is hybrid-sharded.
  std::vector<int> ReplicaServers() {
    absl::MutexLock lock(&mu_);
    const int shards = num_servers() / replicas_;
    const int first = (options_.worker_rank % replicas_) * shards;
    std::vector<int> servers;
    for (int i = 0; i < shards; ++i) servers.push_back(first + i);
    return servers;
  }

  // GatherGroups and ScatterGroups: each group's buffer split by server, the groups that
  // split moved by `move` (a future each, in their order), the others' errors ready.
  template <typename Result, typename Move>
  std::vector<std::future<Result>> ForEachGroup(const std::vector<std::string>& groups, DType dtype,
                                                const std::vector<absl::Span<std::byte>>& buffers, Move move) {
    std::vector<std::future<Result>> futures(groups.size());
    if (buffers.size() != groups.size()) {
      for (std::future<Result>& future : futures) {
        future = ReadyFuture<Result>(absl::InvalidArgumentError(
            absl::StrCat(groups.size(), " groups but ", buffers.size(), " buffers")));
      }
      return futures;
    }
    std::vector<client_internal::DataTransfers::GroupParts> split;
    std::vector<size_t> split_index;
    for (size_t g = 0; g < groups.size(); ++g) {
      absl::StatusOr<std::vector<absl::Span<std::byte>>> parts = Split(groups[g], dtype, buffers[g]);
      if (!parts.ok()) {
        futures[g] = ReadyFuture<Result>(parts.status());
        continue;
      }
      split.push_back({groups[g], *std::move(parts)});
      split_index.push_back(g);
    }
    if (split.empty()) return futures;
    std::vector<std::future<Result>> moved = move(split);
    for (size_t k = 0; k < moved.size(); ++k) futures[split_index[k]] = std::move(moved[k]);
    return futures;
  }

  // Splits a full flat buffer (padded_numel elements of dtype) into per-server slices,
  // indexed by rank: shard i goes to server i of this worker's replica group.
  absl::StatusOr<std::vector<absl::Span<std::byte>>> Split(const std::string& group, DType dtype,
                                                           absl::Span<std::byte> full) {
    FLATSHARD_ASSIGN_OR_RETURN(const FlatLayout* layout, FindLayout(group));
    if (!IsFloatingParamDType(dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", DTypeName(dtype), " is not float32, bfloat16 or float16"));
    }
    const size_t slice = static_cast<size_t>(layout->shard_numel()) * DTypeSize(dtype);
    const size_t shards = static_cast<size_t>(layout->num_shards());
    if (full.size() != slice * shards) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffer for group '", group, "' holds ", full.size(), " bytes; expected ",
                       slice * shards, " (padded_numel ", layout->padded_numel(), " x ",
                       DTypeSize(dtype), " bytes of ", DTypeName(dtype), ")"));
    }
    std::vector<absl::Span<std::byte>> parts(num_servers());
    for (int rank = 0; rank < num_servers(); ++rank) {
      parts[rank] = full.subspan((rank % shards) * slice, slice);
    }
    return parts;
  }

  const ClientOptions options_;
  std::unique_ptr<client_internal::ControlPlane> control_;
  std::unique_ptr<client_internal::CheckpointCalls> checkpoints_;
  client_internal::SentSteps sent_;  // this client's gradients, for the cut of its saves
  std::unique_ptr<client_internal::DataTransfers> transfers_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FlatLayout>> layouts_ ABSL_GUARDED_BY(mu_);
  int replicas_ ABSL_GUARDED_BY(mu_) = 1;  // the job's replica groups, from RegisterGroup
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  auto client = std::make_unique<ClientImpl>(std::move(options));
  FLATSHARD_RETURN_IF_ERROR(client->Init());
  return client;
}

}  // namespace flatshard
