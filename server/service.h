// FlatshardService: the gRPC control plane of one server, a thin layer that admits calls
// (the cluster's token; none once Stop is called), converts protobufs to domain types and
// calls the Registry and Groups. Uses gRPC's synchronous API on purpose: WaitVersion
// blocks until a version exists (or its client goes), and the sync server's thread pool
// is the right home for that. Thread-safe.
#ifndef FLATSHARD_SERVER_SERVICE_H_
#define FLATSHARD_SERVER_SERVICE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/flatshard.grpc.pb.h"
#include "server/auth.h"
#include "server/checkpoint_store.h"
#include "server/clip_coordinator.h"
#include "server/nccl_plane.h"
#include "server/registry.h"
#include "server/stats.h"

namespace flatshard::server {

struct ServiceIdentity {
  int rank = 0;
  std::vector<std::string> cluster;
  std::string control_address;
  std::string data_address;
  std::string memory = "host";
  std::string gpu_uuid;    // --memory=device: the GPU holding the shards
  std::string auth_token;  // empty: no authentication
  bool tls = false;        // the control plane speaks TLS
  bool tls_client_certificates = false;  // and asks every caller for a certificate
  bool data_tls = false;                 // the data plane speaks TLS too
  // With TLS: when the certificate chain presented now expires (server/tls.h).
  std::function<absl::Time()> tls_expiry = {};
  int compute_threads = 1;  // the CPU tiers' kernel threads (server/compute_pool.h)
  std::string metrics_address;  // where Prometheus scrapes /metrics (empty: not served)
};

class FlatshardService final : public v1::Flatshard::Service {
 public:
  FlatshardService(ServiceIdentity identity, Registry& registry, ClipCoordinator& clip,
                   CheckpointStore& checkpoints, SessionTokens& sessions, const ServerStats& stats,
                   NcclPlane& nccl, std::function<std::string()> cluster_check);

  grpc::Status GetClusterInfo(grpc::ServerContext* ctx, const v1::GetClusterInfoRequest* request,
                              v1::ClusterInfo* response) override;
  grpc::Status OpenSession(grpc::ServerContext* ctx, const v1::OpenSessionRequest* request,
                           v1::OpenSessionResponse* response) override;
  grpc::Status OpenNcclChannel(grpc::ServerContext* ctx, const v1::OpenNcclChannelRequest* request,
                               v1::OpenNcclChannelResponse* response) override;
  grpc::Status ConfigureJob(grpc::ServerContext* ctx, const v1::ConfigureJobRequest* request,
                            v1::ConfigureJobResponse* response) override;
  grpc::Status DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* request,
                         v1::DeleteJobResponse* response) override;
  grpc::Status RegisterGroup(grpc::ServerContext* ctx, const v1::RegisterGroupRequest* request,
                             v1::RegisterGroupResponse* response) override;
  grpc::Status InitGroup(grpc::ServerContext* ctx, const v1::InitGroupRequest* request,
                         v1::InitGroupResponse* response) override;
  grpc::Status SetHyperparams(grpc::ServerContext* ctx, const v1::SetHyperparamsRequest* request,
                              v1::SetHyperparamsResponse* response) override;
  grpc::Status WaitVersion(grpc::ServerContext* ctx, const v1::WaitVersionRequest* request,
                           v1::WaitVersionResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest* request,
                         v1::ServerStatus* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* ctx,
                              grpc::ServerReaderWriter<v1::SaveAnswer, v1::SaveCheckpointStep>* stream) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* ctx, const v1::LoadCheckpointRequest* request,
                              v1::CheckpointResponse* response) override;
  grpc::Status ListCheckpoints(grpc::ServerContext* ctx, const v1::ListCheckpointsRequest* request,
                               v1::ListCheckpointsResponse* response) override;
  grpc::Status DeleteCheckpoint(grpc::ServerContext* ctx, const v1::CheckpointRequest* request,
                                v1::CheckpointResponse* response) override;
  grpc::Status ExportStateDict(grpc::ServerContext* ctx,
                               grpc::ServerReaderWriter<v1::ExportMessage, v1::ExportStep>* stream) override;
  grpc::Status ImportCheckpoint(grpc::ServerContext* ctx, grpc::ServerReader<v1::ImportMessage>* reader,
                                v1::ImportResponse* response) override;
  grpc::Status WriteCheckpointPart(grpc::ServerContext* ctx, grpc::ServerReader<v1::CheckpointPartMessage>* reader,
                                   v1::WriteCheckpointPartResponse* response) override;
  grpc::Status ReadCheckpointFile(grpc::ServerContext* ctx, const v1::ReadCheckpointFileRequest* request,
                                  grpc::ServerWriter<v1::ReadCheckpointFileChunk>* writer) override;
  grpc::Status PushNormPartial(grpc::ServerContext* ctx, const v1::PushNormPartialRequest* request,
                               v1::PushNormPartialResponse* response) override;
  grpc::Status GetGradNorm(grpc::ServerContext* ctx, const v1::GetGradNormRequest* request,
                           v1::GetGradNormResponse* response) override;

  // What GetStatus answers to `request`; also what the metrics endpoint serves
  // (server/metrics.h), with every group.
  v1::ServerStatus Status(const v1::GetStatusRequest& request = {});

  // Refuses every call that begins from now on with `why` (the server is shutting down:
  // the calls in progress finish within its grace, no new one starts).
  void Stop(absl::Status why);

 private:
  // OK for a call that may proceed: UNAUTHENTICATED without the cluster's token, and the
  // reason given to Stop once stopped.
  grpc::Status Admit(const grpc::ServerContext* ctx) const;

  const ServiceIdentity identity_;
  Registry& registry_;
  ClipCoordinator& clip_;
  CheckpointStore& checkpoints_;
  SessionTokens& sessions_;
  const ServerStats& stats_;
  NcclPlane& nccl_;
  const std::function<std::string()> cluster_check_;
  const absl::Time started_ = absl::Now();
  mutable absl::Mutex stop_mu_;
  absl::Status stopped_ ABSL_GUARDED_BY(stop_mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SERVICE_H_
