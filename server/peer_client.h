// PeerClient: this server's gRPC client to the other servers of the cluster, for what
// needs agreement between them (the gradient norm of a clipped job). Channels are made
// once; calls carry the cluster token. Thread-safe.
//
//   PeerClient peers(cluster, rank, token);
//   FLATSHARD_RETURN_IF_ERROR(peers.SendNormPartial(1, "job", step, partial));
#ifndef FLATSHARD_SERVER_PEER_CLIENT_H_
#define FLATSHARD_SERVER_PEER_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/flatshard.grpc.pb.h"

namespace flatshard::server {

class PeerClient {
 public:
  PeerClient(std::vector<std::string> cluster, int rank, std::string token,
             absl::Duration give_up_after = absl::Seconds(30));

  // Delivers this server's norm share to `peer`, retrying while it is unreachable (a
  // peer still starting or restarting) for up to give_up_after; then Unavailable.
  // Other errors are returned at once.
  [[nodiscard]] absl::Status SendNormPartial(int peer, const std::string& job, int64_t step,
                                             double partial);

  // Asks `peer` for its view of the cluster (one try, `timeout`). FailedPrecondition
  // naming the difference if it reports another list or another rank; Unavailable (or
  // the RPC's error) if it does not answer.
  [[nodiscard]] absl::Status CheckAgreement(int peer, absl::Duration timeout);

 private:
  const std::vector<std::string> cluster_;
  const int rank_;
  const std::string token_;
  const absl::Duration give_up_after_;
  std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_PEER_CLIENT_H_
