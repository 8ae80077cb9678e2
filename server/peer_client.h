// PeerClient: this server's gRPC client to the other servers of the cluster, for what
// needs agreement between them (the gradient norm of a clipped job, data sessions for
// the gradient exchange of a hybrid-sharded one) and for checkpoints
// kept in server 0's root when the servers' roots differ (streaming a part of a save
// there, reading byte ranges back for a load). Channels are made once; calls carry the
// cluster token. Thread-safe.
//
//   PeerClient peers(cluster, rank, token, PeerCredentials(tls));
//   FLATSHARD_RETURN_IF_ERROR(peers.SendNormPartial(1, "job", step, partial));
#ifndef FLATSHARD_SERVER_PEER_CLIENT_H_
#define FLATSHARD_SERVER_PEER_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/flatshard.grpc.pb.h"
#include "server/checkpoint_sink.h"

namespace flatshard::server {

// This server's part of a checkpoint save, streamed to the peer that keeps the checkpoint
// in its root (WriteCheckpointPart): the files go out as chunks of at most 4 MiB, which
// gRPC's flow control holds to a few in flight. Finish ends the stream with the part's
// description and returns the peer's verdict; after an error, every call returns it.
// One writer; not thread-safe.
class PeerPartWriter final : public CheckpointSink {
 public:
  PeerPartWriter(v1::Flatshard::Stub& stub, const std::string& token, std::string peer_address, const std::string& name,
                 const std::string& save_id, int rank, bool async, absl::Time deadline);
  ~PeerPartWriter() override;

  absl::Status Open(const std::string& file, uint64_t size, bool exclusive) override;
  absl::Status Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) override;
  absl::Status Close(const std::string& file) override;
  // Sends `part` (JSON) last and waits for the peer to have written the part down.
  [[nodiscard]] absl::Status Finish(const std::string& part);

 private:
  absl::Status Send(const v1::CheckpointPartMessage& message);
  absl::Status End();  // closes the stream; the peer's status

  const std::string peer_address_;
  grpc::ClientContext ctx_;
  v1::WriteCheckpointPartResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::CheckpointPartMessage>> writer_;
  absl::Status error_;
  bool ended_ = false;
};

class PeerClient {
 public:
  // Calls the peers with `credentials` (server/tls.h: PeerCredentials).
  PeerClient(std::vector<std::string> cluster, int rank, std::string token,
             std::shared_ptr<grpc::ChannelCredentials> credentials,
             absl::Duration give_up_after = absl::Seconds(30));

  // Delivers this server's norm share (of the job's `epoch`: server/clip_coordinator.h)
  // to `peer`, retrying while it is unreachable or answers Unavailable (a peer still
  // starting or restarting, or not yet at `epoch`) for up to give_up_after; then
  // Unavailable. Other errors are returned at once.
  [[nodiscard]] absl::Status SendNormPartial(int peer, const std::string& job, int64_t step, double partial,
                                             uint64_t epoch);

  // A data-plane session on `peer` (OpenSession), retried as SendNormPartial is.
  struct Session {
    std::string token;
    std::string data_address;
    bool tls = false;  // its data plane speaks TLS
  };
  [[nodiscard]] absl::StatusOr<Session> OpenSession(int peer);

  // Asks `peer` for its view of the cluster (one try, `timeout`). FailedPrecondition
  // naming the difference if it reports another list or another rank; Unavailable (or
  // the RPC's error) if it does not answer.
  [[nodiscard]] absl::Status CheckAgreement(int peer, absl::Duration timeout);

  // Starts streaming this server's part of checkpoint `name` to `peer`'s root.
  // Unavailable if `peer` cannot be reached within 10 s.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<PeerPartWriter>> WritePart(int peer, const std::string& name,
                                                                          const std::string& save_id, bool async,
                                                                          absl::Time deadline);
  // `length` bytes at `offset` of `file` of committed checkpoint `name` in `peer`'s root,
  // into `out` (unverified: the caller checks them against the manifest). DataLoss if the
  // file ends first; the peer's error (naming it) otherwise.
  [[nodiscard]] absl::Status ReadCheckpointFile(int peer, const std::string& name, const std::string& file,
                                                uint64_t offset, uint64_t length, std::byte* out);
  // The whole file (the manifest, whose size nothing records).
  [[nodiscard]] absl::StatusOr<std::string> ReadCheckpointFile(int peer, const std::string& name,
                                                               const std::string& file);

  const std::string& address(int peer) const { return cluster_[peer]; }

 private:
  const std::vector<std::string> cluster_;
  const int rank_;
  const std::string token_;
  const absl::Duration give_up_after_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::Flatshard::Stub>> stubs_;

  // OK once the channel to `peer` is connected; Unavailable after 10 s.
  absl::Status Reach(int peer);
  template <typename Call>
  absl::Status Retried(int peer, Call call);

  // Streams [offset, offset + length) (length 0: to the end) to `deliver`, chunk by chunk.
  absl::Status ReadRange(int peer, const std::string& name, const std::string& file, uint64_t offset,
                         uint64_t length, const std::function<void(const std::string&)>& deliver);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_PEER_CLIENT_H_
