// HTTP/2 keepalive on the control plane. Checkpoint calls last as long as the model takes
// to write or read, with no per-call deadline; what bounds them when a server dies, hangs
// or is cut off is the caller's keepalive: a ping every `interval` while calls are in
// flight (also when no data moves, as while a server writes its part), and the
// connection closed, failing its calls with UNAVAILABLE, when a ping goes unanswered for
// as long again. Servers accept pings as often as kMinKeepaliveInterval. Pure functions.
//
//   grpc::ChannelArguments args;
//   SetKeepalive(args, absl::Seconds(15));
//   auto channel = grpc::CreateCustomChannel(address, credentials, args);
#ifndef FLATSHARD_PROTO_KEEPALIVE_H_
#define FLATSHARD_PROTO_KEEPALIVE_H_

#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/time/time.h"

namespace flatshard {

// The shortest ping interval a server takes without calling it abuse.
inline constexpr absl::Duration kMinKeepaliveInterval = absl::Seconds(1);

// A caller's channel: pings every `interval` (at least kMinKeepaliveInterval) while
// calls are in flight, each answered within `interval`.
void SetKeepalive(grpc::ChannelArguments& args, absl::Duration interval);

// A server's: accepts those pings, down to kMinKeepaliveInterval apart.
void AcceptKeepalive(grpc::ServerBuilder& builder);

}  // namespace flatshard

#endif  // FLATSHARD_PROTO_KEEPALIVE_H_
