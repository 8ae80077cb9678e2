// What a server says about itself (v1::ClusterInfo, the GetClusterInfo RPC), and the
// check every client and peer server makes of it before anything else: the server is
// the rank it is expected to be, of the same cluster, and speaks the same protocol
// revision. Pure functions; thread-safe.
//
//   FLATSHARD_RETURN_IF_ERROR(CheckClusterInfo(info, servers, rank, "this client"));
#ifndef FLATSHARD_PROTO_CLUSTER_INFO_H_
#define FLATSHARD_PROTO_CLUSTER_INFO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/flatshard.pb.h"

namespace flatshard {

// The revision of flatshard's wire protocols: the control plane's rules (what a request
// must carry) and the data plane's framing. Bumped by every change that an older client
// or server would misread; clients and servers of one revision work together, others
// are refused on connecting. Revision 2: loads carry their id, exchange messages the
// load their state comes from. Revision 3: every data-plane header names a load
// (transport/data_protocol.h), so gathers and scatters are checked against it too.
// Revision 4: a load's id comes with its preparation (the staged load it names); the
// DeleteJob RPC. Revision 5: saves and exports say how long a server waits for their cut
// (cut_wait_ms), their streams lasting as long as the checkpoint takes; a load's client
// renews its staging on the servers that prepared while others still do (RENEW).
// Revision 6: WaitVersion and SetHyperparams take several groups at once. Revision 7:
// so does RegisterGroup. Revision 8: SetHyperparams on the data plane too (kSetHyperparams).
// Revision 9: ImportCheckpoint. Revision 10: it takes SHARDED exports (weights_only,
// kind).
inline constexpr uint32_t kProtocolRevision = 10;

// This build's version (CMake's PROJECT_VERSION), "0.1.0".
absl::string_view FlatshardVersion();

// OK when `info` (the answer of the server at `cluster[rank]`) names that rank of
// `cluster` and kProtocolRevision; FailedPrecondition naming both sides otherwise.
// `caller` says who checks, for the message: "this client", "this server (rank 1)".
[[nodiscard]] absl::Status CheckClusterInfo(const v1::ClusterInfo& info, const std::vector<std::string>& cluster,
                                            int rank, absl::string_view caller);

}  // namespace flatshard

#endif  // FLATSHARD_PROTO_CLUSTER_INFO_H_
