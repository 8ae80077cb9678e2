#include "server/peer_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace flatshard::server {

PeerClient::PeerClient(std::vector<std::string> cluster, int rank, std::string token,
                       absl::Duration give_up_after)
    : cluster_(std::move(cluster)), rank_(rank), token_(std::move(token)), give_up_after_(give_up_after) {
  // Peers start at about the same time: retry connecting quickly, not after gRPC's
  // default 1 s backoff.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  for (const std::string& address : cluster_) {
    stubs_.push_back(v1::Flatshard::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
}

absl::Status PeerClient::SendNormPartial(int peer, const std::string& job, int64_t step,
                                         double partial) {
  v1::PushNormPartialRequest request;
  request.set_job(job);
  request.set_step(step);
  request.set_rank(rank_);
  request.set_partial(partial);
  const absl::Time give_up = absl::Now() + give_up_after_;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(5))));
    ctx.set_wait_for_ready(true);  // a peer still starting: wait for it, not for a backoff
    if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
    v1::PushNormPartialResponse response;
    const grpc::Status status = stubs_[peer]->PushNormPartial(&ctx, request, &response);
    if (status.ok()) return absl::OkStatus();
    const bool retry = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                       status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!retry || absl::Now() >= give_up) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat(cluster_[peer], ": ", status.error_message()));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::Status PeerClient::CheckAgreement(int peer, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ctx.set_wait_for_ready(true);
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  v1::ClusterInfo info;
  const grpc::Status status = stubs_[peer]->GetClusterInfo(&ctx, v1::GetClusterInfoRequest(), &info);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat(cluster_[peer], ": ", status.error_message()));
  }
  const std::vector<std::string> theirs(info.cluster().begin(), info.cluster().end());
  if (theirs != cluster_ || info.rank() != peer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "server ", cluster_[peer], " is rank ", info.rank(), " of [", absl::StrJoin(theirs, ","),
        "]; this server (rank ", rank_, ") expects rank ", peer, " of [",
        absl::StrJoin(cluster_, ","), "]"));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
