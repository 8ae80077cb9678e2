// Cancellation: a cancel reaches the calls registered now and later, until the call
// seals it; CancellationSet reaches the calls in progress only.
#include "client/call_cancellation.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>

#include "proto/flatshard.grpc.pb.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::client_internal {
namespace {

// A unary call on `ctx` to a loopback port where nothing listens: CANCELLED when the
// context was cancelled, UNAVAILABLE otherwise.
grpc::StatusCode CallNowhere(grpc::ClientContext& ctx) {
  static const int port = transport::PickFreeLoopbackPorts(1)->front();
  auto stub = v1::Flatshard::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ServerStatus status;
  return stub->GetStatus(&ctx, v1::GetStatusRequest(), &status).error_code();
}

TEST(CancellationTest, ACancelReachesTheCallsRegisteredBeforeAndAfterIt) {
  Cancellation cancellation;
  grpc::ClientContext before, after, unregistered;
  {
    const Registration registered(&cancellation, &before);
    cancellation.Cancel();
    EXPECT_TRUE(cancellation.cancelled());
    EXPECT_EQ(CallNowhere(before), grpc::StatusCode::CANCELLED);
  }
  const Registration registered(&cancellation, &after);
  EXPECT_EQ(CallNowhere(after), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(CallNowhere(unregistered), grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(cancellation.Seal());  // too late to go on
}

TEST(CancellationTest, ASealedCallIsNoLongerCancelled) {
  Cancellation cancellation;
  ASSERT_TRUE(cancellation.Seal());
  cancellation.Cancel();
  EXPECT_FALSE(cancellation.cancelled());
  grpc::ClientContext ctx;
  const Registration registered(&cancellation, &ctx);
  EXPECT_EQ(CallNowhere(ctx), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(cancellation.Seal());
}

TEST(CancellationSetTest, CancelAllReachesTheCallsInProgressOnly) {
  CancellationSet set;
  std::optional<CancellationSet::Scope> first(std::in_place, set);
  {
    CancellationSet::Scope second(set);
    set.CancelAll();
    EXPECT_TRUE((*first)->cancelled());
    EXPECT_TRUE(second->cancelled());
  }
  first.reset();
  CancellationSet::Scope later(set);
  EXPECT_FALSE(later->cancelled());
}

}  // namespace
}  // namespace flatshard::client_internal
