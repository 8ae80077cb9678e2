#include "client/cluster_status.h"

#include "client/control_channel.h"
#include "client/control_plane.h"
#include "client/proto_json.h"
#include "proto/flatshard.grpc.pb.h"

namespace flatshard {

std::vector<absl::StatusOr<v1::ServerStatus>> FetchClusterStatus(const ClientOptions& options, std::stop_token stop,
                                                                 const v1::GetStatusRequest& request) {
  std::vector<absl::StatusOr<v1::ServerStatus>> result;
  absl::StatusOr<std::unique_ptr<client_internal::ControlPlane>> control =
      client_internal::ControlPlane::Create(options);
  for (size_t i = 0; i < options.servers.size(); ++i) {
    if (!control.ok()) {
      result.emplace_back(control.status());
      continue;
    }
    v1::ServerStatus status;
    const absl::Status called = (*control)->Call(i, &v1::Flatshard::Stub::PrepareAsyncGetStatus, request, &status,
                                                 absl::ZeroDuration(), nullptr, stop);
    if (called.ok()) {
      result.emplace_back(std::move(status));
    } else {
      result.emplace_back(client_internal::WithUnreachableHint(called, options));
    }
  }
  return result;
}

std::string ClusterStatusJson(const std::vector<std::string>& servers,
                              const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses,
                              int indent) {
  JsonWriter json(indent);
  json.BeginObject();
  json.Key("servers");
  json.BeginArray();
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok()) {
      json.Message(*statuses[i]);
      continue;
    }
    json.BeginObject();
    json.Key("address");
    json.String(servers[i]);
    json.Key("error");
    json.String(statuses[i].status().message());
    json.EndObject();
  }
  json.EndArray();
  json.EndObject();
  return json.Take();
}

}  // namespace flatshard
