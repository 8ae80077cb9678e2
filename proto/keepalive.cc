#include "proto/keepalive.h"

#include <algorithm>

namespace flatshard {

void SetKeepalive(grpc::ChannelArguments& args, absl::Duration interval) {
  const int ms =
      static_cast<int>(absl::ToInt64Milliseconds(std::clamp(interval, kMinKeepaliveInterval, absl::Hours(1))));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms);
  // gRPC stops pinging after 2 pings without data otherwise: a server writing a
  // checkpoint for minutes sends none.
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

void AcceptKeepalive(grpc::ServerBuilder& builder) {
  // gRPC's default (5 min) would take a ping every 15 s for abuse and close the
  // connection after two.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(kMinKeepaliveInterval)));
}

}  // namespace flatshard
