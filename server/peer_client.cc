#include "server/peer_client.h"

#include <grpcpp/grpcpp.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "proto/cluster_info.h"
#include "proto/keepalive.h"

namespace flatshard::server {
namespace {

// How often a server pings a peer it waits on (proto/keepalive.h): a dead or hung peer
// fails the call within twice this.
constexpr absl::Duration kPeerKeepalive = absl::Seconds(15);

// Data per message of checkpoint bytes between servers: gRPC streams 4 MiB messages at
// several times the rate of one large one.
constexpr size_t kChunkBytes = size_t{4} << 20;

absl::Status FromGrpc(const grpc::Status& status, const std::string& peer) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(peer, ": ", status.error_message()));
}

}  // namespace

PeerPartWriter::PeerPartWriter(v1::Flatshard::Stub& stub, const std::string& token, std::string peer_address,
                               const std::string& name, const std::string& save_id, int rank, bool async,
                               absl::Time deadline)
    : peer_address_(std::move(peer_address)) {
  if (deadline != absl::InfiniteFuture()) ctx_.set_deadline(absl::ToChronoTime(deadline));
  if (!token.empty()) ctx_.AddMetadata("authorization", "Bearer " + token);
  writer_ = stub.WriteCheckpointPart(&ctx_, &response_);
  v1::CheckpointPartMessage first;
  first.set_name(name);
  first.set_rank(rank);
  first.set_async(async);
  first.set_save_id(save_id);
  error_ = Send(first);
}

PeerPartWriter::~PeerPartWriter() {
  if (!ended_) {
    ctx_.TryCancel();  // abandoned mid-way (an error here): the peer drops the part
    (void)End();
  }
}

absl::Status PeerPartWriter::Send(const v1::CheckpointPartMessage& message) {
  if (!error_.ok()) return error_;
  if (!writer_->Write(message)) {
    // The peer ended the stream: its status says why.
    error_ = End();
    if (error_.ok()) error_ = absl::UnavailableError(absl::StrCat(peer_address_, " closed the checkpoint stream"));
  }
  return error_;
}

absl::Status PeerPartWriter::End() {
  ended_ = true;
  writer_->WritesDone();
  return FromGrpc(writer_->Finish(), peer_address_);
}

absl::Status PeerPartWriter::Open(const std::string& file, uint64_t size, bool exclusive) {
  v1::CheckpointPartMessage message;
  message.mutable_chunk()->set_file(file);
  message.mutable_chunk()->set_file_size(size);
  message.set_open(true);
  message.set_exclusive(exclusive);
  return Send(message);
}

absl::Status PeerPartWriter::Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) {
  for (size_t done = 0; done < data.size(); done += kChunkBytes) {
    const size_t count = std::min(kChunkBytes, data.size() - done);
    v1::CheckpointPartMessage message;
    message.mutable_chunk()->set_file(file);
    message.mutable_chunk()->set_offset(offset + done);
    message.mutable_chunk()->set_data(reinterpret_cast<const char*>(data.data() + done), count);
    FLATSHARD_RETURN_IF_ERROR(Send(message));
  }
  return absl::OkStatus();
}

absl::Status PeerPartWriter::Close(const std::string& file) {
  v1::CheckpointPartMessage message;
  message.mutable_chunk()->set_file(file);
  message.mutable_chunk()->set_close(true);
  return Send(message);
}

absl::Status PeerPartWriter::Finish(const std::string& part) {
  v1::CheckpointPartMessage message;
  message.set_part(part);
  FLATSHARD_RETURN_IF_ERROR(Send(message));
  return End();
}

PeerClient::PeerClient(std::vector<std::string> cluster, int rank, std::string token,
                       std::shared_ptr<grpc::ChannelCredentials> credentials,
                       absl::Duration give_up_after)
    : cluster_(std::move(cluster)), rank_(rank), token_(std::move(token)), give_up_after_(give_up_after) {
  // Peers start at about the same time: retry connecting quickly, not after gRPC's
  // default 1 s backoff.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetMaxReceiveMessageSize(16 << 20);  // checkpoint file chunks of 4 MiB
  // A part streamed to server 0 has no deadline (an async save's) or the client's:
  // pings tell a peer that died or hangs.
  SetKeepalive(args, kPeerKeepalive);
  for (const std::string& address : cluster_) {
    channels_.push_back(grpc::CreateCustomChannel(address, credentials, args));
    stubs_.push_back(v1::Flatshard::NewStub(channels_.back()));
  }
}

// Calls `call(ctx)` until it succeeds, fails otherwise than by being unreachable, or
// `give_up_after` passes: a peer still starting or restarting is waited for.
template <typename Call>
absl::Status PeerClient::Retried(int peer, Call call) {
  const absl::Time give_up = absl::Now() + give_up_after_;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(5))));
    ctx.set_wait_for_ready(true);  // a peer still starting: wait for it, not for a backoff
    if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
    const grpc::Status status = call(ctx);
    if (status.ok()) return absl::OkStatus();
    const bool retry = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                       status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!retry || absl::Now() >= give_up) return FromGrpc(status, cluster_[peer]);
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::Status PeerClient::SendNormPartial(int peer, const std::string& job, int64_t step, double partial,
                                         uint64_t epoch) {
  v1::PushNormPartialRequest request;
  request.set_job(job);
  request.set_step(step);
  request.set_rank(rank_);
  request.set_partial(partial);
  request.set_epoch(epoch);
  v1::PushNormPartialResponse response;
  return Retried(peer, [&](grpc::ClientContext& ctx) {
    return stubs_[peer]->PushNormPartial(&ctx, request, &response);
  });
}

absl::StatusOr<PeerClient::Session> PeerClient::OpenSession(int peer) {
  const v1::OpenSessionRequest request;
  v1::OpenSessionResponse response;
  FLATSHARD_RETURN_IF_ERROR(Retried(peer, [&](grpc::ClientContext& ctx) {
    return stubs_[peer]->OpenSession(&ctx, request, &response);
  }));
  return Session{response.session_token(), response.data_address(), response.data_tls()};
}

absl::Status PeerClient::CheckAgreement(int peer, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ctx.set_wait_for_ready(true);
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  v1::ClusterInfo info;
  const grpc::Status status = stubs_[peer]->GetClusterInfo(&ctx, v1::GetClusterInfoRequest(), &info);
  if (!status.ok()) return FromGrpc(status, cluster_[peer]);
  return CheckClusterInfo(info, cluster_, peer, absl::StrCat("this server (rank ", rank_, ")"));
}

absl::Status PeerClient::Reach(int peer) {
  // A channel made before the peer listened may be backing off: wait for it to connect,
  // briefly (a dead peer fails the call rather than holding it).
  if (channels_[peer]->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10)))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("server ", cluster_[peer], " is unreachable"));
}

absl::StatusOr<std::unique_ptr<PeerPartWriter>> PeerClient::WritePart(int peer, const std::string& name,
                                                                      const std::string& save_id, bool async,
                                                                      absl::Time deadline) {
  FLATSHARD_RETURN_IF_ERROR(Reach(peer));
  return std::make_unique<PeerPartWriter>(*stubs_[peer], token_, cluster_[peer], name, save_id, rank_, async, deadline);
}

absl::Status PeerClient::ReadRange(int peer, const std::string& name, const std::string& file, uint64_t offset,
                                   uint64_t length, const std::function<void(const std::string&)>& deliver) {
  FLATSHARD_RETURN_IF_ERROR(Reach(peer));
  grpc::ClientContext ctx;
  // A range is at most one load task (64 MiB) or a manifest: minutes mean a stuck peer.
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  v1::ReadCheckpointFileRequest request;
  request.set_name(name);
  request.set_file(file);
  request.set_offset(offset);
  request.set_length(length);
  std::unique_ptr<grpc::ClientReader<v1::ReadCheckpointFileChunk>> reader = stubs_[peer]->ReadCheckpointFile(&ctx, request);
  v1::ReadCheckpointFileChunk chunk;
  while (reader->Read(&chunk)) deliver(chunk.data());
  return FromGrpc(reader->Finish(), cluster_[peer]);
}

absl::Status PeerClient::ReadCheckpointFile(int peer, const std::string& name, const std::string& file,
                                            uint64_t offset, uint64_t length, std::byte* out) {
  if (length == 0) return absl::OkStatus();
  uint64_t got = 0;
  bool overflow = false;
  FLATSHARD_RETURN_IF_ERROR(ReadRange(peer, name, file, offset, length, [&](const std::string& data) {
    if (got + data.size() > length) {
      overflow = true;
      return;
    }
    std::memcpy(out + got, data.data(), data.size());
    got += data.size();
  }));
  if (overflow || got != length) {
    return absl::DataLossError(absl::StrCat(cluster_[peer], ": checkpoint '", name, "' file '", file, "' sent ",
                                            overflow ? "more" : absl::StrCat(got), " bytes of [", offset, ", ",
                                            offset + length, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PeerClient::ReadCheckpointFile(int peer, const std::string& name,
                                                           const std::string& file) {
  std::string contents;
  FLATSHARD_RETURN_IF_ERROR(
      ReadRange(peer, name, file, 0, 0, [&](const std::string& data) { contents.append(data); }));
  return contents;
}

}  // namespace flatshard::server
