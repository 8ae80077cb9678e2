#include "client/cluster_status.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "client/control_channel.h"
#include "proto/flatshard.grpc.pb.h"

namespace flatshard {

std::vector<absl::StatusOr<v1::ServerStatus>> FetchClusterStatus(const ClientOptions& options) {
  std::vector<absl::StatusOr<v1::ServerStatus>> result;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      client_internal::ControlPlaneCredentials(options.tls_ca_file);
  for (const std::string& address : options.servers) {
    if (!credentials.ok()) {
      result.emplace_back(credentials.status());
      continue;
    }
    auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(address, *credentials));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
    if (!options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options.token);
    v1::ServerStatus status;
    const grpc::Status rpc = stub->GetStatus(&ctx, v1::GetStatusRequest(), &status);
    if (rpc.ok()) {
      result.emplace_back(std::move(status));
    } else {
      result.emplace_back(client_internal::WithTlsHint(
          absl::Status(static_cast<absl::StatusCode>(rpc.error_code()),
                       absl::StrCat(address, ": ", rpc.error_message())),
          options.tls_ca_file));
    }
  }
  return result;
}

std::string ClusterStatusJson(const std::vector<std::string>& servers,
                              const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses,
                              int indent) {
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      out.push_back({{"address", servers[i]}, {"error", std::string(statuses[i].status().message())}});
      continue;
    }
    std::string text;
    google::protobuf::util::JsonPrintOptions print;
    print.always_print_primitive_fields = true;
    print.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(*statuses[i], &text, print);
    out.push_back(nlohmann::json::parse(text));
  }
  return nlohmann::json{{"servers", out}}.dump(indent);
}

}  // namespace flatshard
