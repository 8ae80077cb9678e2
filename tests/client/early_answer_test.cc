#include "client/early_answer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>

#include "absl/time/clock.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::client_internal {
namespace {

using ::testing::HasSubstr;

// A loopback connection: `worker` is the side an EarlyAnswer watches, `server` answers.
struct Connected {
  std::unique_ptr<transport::Listener> listener;
  std::unique_ptr<transport::Connection> worker;
  std::unique_ptr<transport::Connection> server;
};

Connected Connect() {
  Connected pair;
  auto listener = transport::ListenTcp("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return pair;
  pair.listener = *std::move(listener);
  auto worker = transport::ConnectTcp("127.0.0.1", pair.listener->port(), absl::Seconds(5));
  auto server = pair.listener->Accept();
  EXPECT_TRUE(worker.ok() && server.ok());
  if (worker.ok()) pair.worker = *std::move(worker);
  if (server.ok()) pair.server = *std::move(server);
  EXPECT_TRUE(pair.worker != nullptr && pair.worker->SetTimeout(absl::Seconds(10)).ok());
  return pair;
}

// Asks `answer` as a waiting transfer does until it has read something (at most 10 s);
// returns what Failed said last.
bool AskUntilAnswered(EarlyAnswer& answer) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    const bool failed = answer.Failed();
    if (answer.has_answer() || absl::Now() > deadline) return failed;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

TEST(EarlyAnswerTest, NothingArrivedEndsNothingAndTakeReadsTheAnswerThatComesLater) {
  Connected pair = Connect();
  ASSERT_NE(pair.server, nullptr);
  EarlyAnswer answer(*pair.worker);
  EXPECT_FALSE(answer.Failed());
  EXPECT_FALSE(answer.has_answer());
  ASSERT_TRUE(transport::SendResponse(*pair.server, absl::OkStatus(), 7, {}, 3).ok());
  absl::StatusOr<transport::Response> taken = answer.Take();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_TRUE(taken->status.ok());
  EXPECT_EQ(taken->version, 7);
  EXPECT_EQ(taken->load_id, 3u);
}

// An OK answer that comes first is kept and ends nothing: the worker's half is about to
// finish. It is read once; what the server sends after it stays on the connection.
TEST(EarlyAnswerTest, AnOkAnswerIsKeptAndEndsNothing) {
  Connected pair = Connect();
  ASSERT_NE(pair.server, nullptr);
  EarlyAnswer answer(*pair.worker);
  ASSERT_TRUE(transport::SendResponse(*pair.server, absl::OkStatus(), 5, {}).ok());
  EXPECT_FALSE(AskUntilAnswered(answer));
  ASSERT_TRUE(answer.has_answer());
  ASSERT_TRUE(transport::SendResponse(*pair.server, absl::OkStatus(), 6, {}).ok());
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(answer.Failed());
  absl::StatusOr<transport::Response> taken = answer.Take();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->version, 5);
  absl::StatusOr<transport::Response> next = transport::RecvResponse(*pair.worker, {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version, 6);
}

// The server's error (its half failed) ends the transfer, and Take gives it.
TEST(EarlyAnswerTest, TheServersErrorEndsTheTransferAndIsTheAnswer) {
  Connected pair = Connect();
  ASSERT_NE(pair.server, nullptr);
  EarlyAnswer answer(*pair.worker);
  const absl::Status refused = absl::DeadlineExceededError("NCCL channel 3 (worker 0): timed out; channel closed");
  ASSERT_TRUE(transport::SendResponse(*pair.server, refused, 0, {}).ok());
  EXPECT_TRUE(AskUntilAnswered(answer));
  absl::StatusOr<transport::Response> taken = answer.Take();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->status, refused);
}

// A server that closes the connection (it is shutting down, its process died) ends the
// transfer; Take says the connection failed.
TEST(EarlyAnswerTest, AClosedConnectionEndsTheTransfer) {
  Connected pair = Connect();
  ASSERT_NE(pair.server, nullptr);
  EarlyAnswer answer(*pair.worker);
  pair.server.reset();
  EXPECT_TRUE(AskUntilAnswered(answer));
  EXPECT_FALSE(answer.Take().ok());
}

}  // namespace
}  // namespace flatshard::client_internal
