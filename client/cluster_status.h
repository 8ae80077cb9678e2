// Fetches every server's status over the control plane, for `flatshard status` and
// tools. Not part of the public client API (it exposes the protobufs). Thread-safe.
//
//   auto statuses = FetchClusterStatus({.servers = {"127.0.0.1:7070"}, .token = token});
#ifndef FLATSHARD_CLIENT_CLUSTER_STATUS_H_
#define FLATSHARD_CLIENT_CLUSTER_STATUS_H_

#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "proto/flatshard.pb.h"

namespace flatshard {

// One entry per server of options.servers, in order: its status as it answers `request`
// (request.omit_groups: without its groups), or why it could not be read
// (options.token, .timeout and .tls_ca_file apply; the rest is unused). A stop asked of
// `stop`'s source ends the calls in progress and those after it, Cancelled.
std::vector<absl::StatusOr<v1::ServerStatus>> FetchClusterStatus(const ClientOptions& options,
                                                                 std::stop_token stop = {},
                                                                 const v1::GetStatusRequest& request = {});

// `flatshard status --json`: {"servers": [status as JSON (proto field names), or
// {"address", "error"} for a server that did not answer]}, indented by `indent` (-1:
// one line).
std::string ClusterStatusJson(const std::vector<std::string>& servers,
                              const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses,
                              int indent = 2);

}  // namespace flatshard

#endif  // FLATSHARD_CLIENT_CLUSTER_STATUS_H_
