#include "client/data_channel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stop_token>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "transport/data_protocol.h"
#include "tests/client/test_data_server.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::client_internal {
namespace {

// What an EchoDataServer does with a request.
enum class Echo {
  kAnswer,  // answers it at once
  // Answers only the hello and holds every request, as a server does while a gather
  // waits for a version, until the client closes the connection.
  kHold,
  // Does not even answer the hello (a server that hangs).
  kHoldHello,
  // Holds it until the client closes what it sends (CloseSend), then answers it, as a
  // CUDA IPC server that was copying when the client stopped: the copy ends, then the
  // answer goes.
  kAnswerOnClose,
};

// A data server on 127.0.0.1 that takes any hello and answers each request with OK and
// the request's own version, so every answer names its request, or holds it as `echo`
// says. With `answers_per_connection` > 0 it closes a connection after that many
// answers.
class EchoDataServer {
 public:
  explicit EchoDataServer(int answers_per_connection = 0, Echo echo = Echo::kAnswer)
      : answers_per_connection_(answers_per_connection), echo_(echo) {}

  DataSession session() const { return server_.session(); }
  int accepted() const { return server_.accepted(); }
  int held() const { return held_.load(); }  // requests it holds or held (Echo)

 private:
  void Serve(transport::Connection& conn) {
    for (int answered = 0; answers_per_connection_ == 0 || answered <= answers_per_connection_; ++answered) {
      absl::StatusOr<transport::Request> request = transport::RecvRequest(conn);
      if (!request.ok() || !transport::DrainPayload(conn, request->payload_bytes).ok()) return;
      if ((echo_ == Echo::kHold && answered > 0) || echo_ == Echo::kHoldHello) {
        ++held_;
        while (transport::RecvRequest(conn).ok()) {
        }
        return;
      }
      if (echo_ == Echo::kAnswerOnClose && answered > 0) {
        ++held_;
        while (!conn.PeerClosed()) absl::SleepFor(absl::Milliseconds(5));
      }
      if (!transport::SendResponse(conn, absl::OkStatus(), request->version, {}).ok()) return;
    }  // the hello's answer is the first
  }

  const int answers_per_connection_;
  const Echo echo_;
  std::atomic<int> held_ = 0;
  TestDataServer server_{[this](transport::Connection& conn) { Serve(conn); }};  // last: it uses the rest
};

// Where a request's two parts ran, and its answer.
struct Outcome {
  std::thread::id wrote_on, read_on;
  absl::StatusOr<int64_t> version;
};

// Submits a request named `version` in two parts, which a stop asked of `stop` ends as
// `cut` says; the future has what happened. A `write_error` replaces the write.
std::future<Outcome> Request(DataChannel& channel, int64_t version, absl::Status write_error = absl::OkStatus(),
                             std::stop_token stop = {}, StopCut cut = StopCut::kConnection) {
  auto outcome = std::make_shared<Outcome>();
  auto done = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> result = done->get_future();
  RequestWriter write = [=](transport::Connection& conn) {
    outcome->wrote_on = std::this_thread::get_id();
    if (!write_error.ok()) return write_error;
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kGather);
    header.version = version;
    return transport::SendRequest(conn, header, "job", "g", {});
  };
  DataTask read = [=](absl::StatusOr<transport::Connection*> conn) {
    outcome->read_on = std::this_thread::get_id();
    bool usable = true;
    if (!conn.ok()) {
      outcome->version = conn.status();
    } else if (absl::StatusOr<transport::Response> response = transport::RecvResponse(**conn, {}); !response.ok()) {
      outcome->version = response.status();
      usable = false;
    } else {
      outcome->version = response->version;
    }
    done->set_value(*outcome);
    return usable;
  };
  channel.Submit(std::move(write), std::move(read), stop, cut);
  return result;
}

Outcome Finished(std::future<Outcome>& future) {
  EXPECT_EQ(future.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "the request never finished";
  return future.get();
}

TEST(DataChannelTest, ARequestIsWrittenByItsSubmitterOnceAConnectionIsOpenAndIdle) {
  EchoDataServer server;
  DataChannel channel(server.session(), nullptr, 1, absl::Seconds(10));
  std::future<Outcome> first = Request(channel, 1);
  const Outcome opened = Finished(first);
  EXPECT_EQ(opened.version.value(), 1);
  // No connection yet: the channel's thread opened one and did both parts.
  EXPECT_NE(opened.wrote_on, std::this_thread::get_id());
  EXPECT_EQ(opened.wrote_on, opened.read_on);

  // The thread sets the answer before it goes back to wait: a request made at once may
  // find the connection busy (then it is queued, as for the first). Once it is idle:
  Outcome idle;
  for (int version = 2; version < 100 && idle.wrote_on != std::this_thread::get_id(); ++version) {
    absl::SleepFor(absl::Milliseconds(10));
    std::future<Outcome> request = Request(channel, version);
    idle = Finished(request);
    EXPECT_EQ(idle.version.value_or(-1), version);
  }
  EXPECT_EQ(idle.wrote_on, std::this_thread::get_id());
  EXPECT_EQ(idle.read_on, opened.read_on);  // the connection's own thread
  EXPECT_EQ(server.accepted(), 1);
}

// Back to back, a request finds the connection its predecessor was written on still
// flagged idle (its thread not yet awake): it must queue, not write on it again.
TEST(DataChannelTest, RequestsSubmittedBackToBackEachGetTheirOwnAnswer) {
  for (int connections : {1, 2}) {
    EchoDataServer server;
    DataChannel channel(server.session(), nullptr, connections, absl::Seconds(10));
    std::vector<std::future<Outcome>> warm;
    for (int i = 0; i < connections; ++i) warm.push_back(Request(channel, -1));
    for (std::future<Outcome>& future : warm) Finished(future);
    std::vector<std::future<Outcome>> requests;
    for (int version = 0; version < 200; ++version) requests.push_back(Request(channel, version));
    for (int version = 0; version < 200; ++version) {
      EXPECT_EQ(Finished(requests[version]).version.value_or(-2), version) << connections << " connections";
    }
  }
}

TEST(DataChannelTest, AFailedWriteReachesTheTaskAndTheNextRequestGetsAFreshConnection) {
  EchoDataServer server;
  DataChannel channel(server.session(), nullptr, 1, absl::Seconds(10));
  std::future<Outcome> first = Request(channel, 1);
  Finished(first);
  std::future<Outcome> failed = Request(channel, 2, absl::DataLossError("cable cut"));
  EXPECT_EQ(Finished(failed).version.status(), absl::DataLossError("cable cut"));
  std::future<Outcome> after = Request(channel, 3);
  EXPECT_EQ(Finished(after).version.value_or(-1), 3);
  EXPECT_EQ(server.accepted(), 2);
}

TEST(DataChannelTest, AConnectionTheServerClosedWhileIdleIsReplacedNotWrittenOn) {
  EchoDataServer server(/*answers_per_connection=*/1);
  DataChannel channel(server.session(), nullptr, 1, absl::Seconds(10));
  for (int version = 1; version <= 3; ++version) {
    std::future<Outcome> request = Request(channel, version);
    EXPECT_EQ(Finished(request).version.value_or(-1), version);
    // Let the server's close arrive before the next request looks at the connection.
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(server.accepted(), 3);
}

TEST(DataChannelTest, DestroyingTheChannelRunsWhatWasSubmitted) {
  EchoDataServer server;
  std::vector<std::future<Outcome>> requests;
  {
    DataChannel channel(server.session(), nullptr, 2, absl::Seconds(10));
    std::future<Outcome> warm = Request(channel, 0);
    Finished(warm);
    for (int version = 1; version <= 20; ++version) requests.push_back(Request(channel, version));
  }
  for (int version = 1; version <= 20; ++version) {
    ASSERT_EQ(requests[version - 1].wait_for(std::chrono::seconds(0)), std::future_status::ready);
    EXPECT_EQ(requests[version - 1].get().version.value_or(-1), version);
  }
}

// Cancel (its owner is being destroyed): a request the server holds fails at once, its
// connection shut down; the ones queued behind it, and those submitted later, run with
// Cancelled and are never sent.
TEST(DataChannelTest, CancelShutsTheTransfersUnderWayAndFailsTheRest) {
  EchoDataServer server(/*answers_per_connection=*/0, Echo::kHold);
  DataChannel channel(server.session(), nullptr, 1, absl::Seconds(60));
  std::future<Outcome> held = Request(channel, 1);
  std::future<Outcome> queued = Request(channel, 2);
  for (int i = 0; i < 2000 && server.held() < 1; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(server.held(), 1);
  channel.Cancel();
  const Outcome cut = Finished(held);  // not the 60 s the channel's timeout allows
  EXPECT_FALSE(cut.version.ok());
  EXPECT_TRUE(absl::IsCancelled(Finished(queued).version.status()));
  std::future<Outcome> later = Request(channel, 3);
  EXPECT_TRUE(absl::IsCancelled(Finished(later).version.status()));
  EXPECT_EQ(server.held(), 1);
}

// A stop ends its own request: one the server holds fails at once, its
// connection shut down, while the other request held beside it waits on; one whose stop
// came before it was submitted is never sent.
TEST(DataChannelTest, AStopEndsItsOwnRequestOnly) {
  EchoDataServer server(/*answers_per_connection=*/0, Echo::kHold);
  DataChannel channel(server.session(), nullptr, 2, absl::Seconds(60));
  std::stop_source stop, other;
  std::future<Outcome> held = Request(channel, 1, absl::OkStatus(), stop.get_token());
  std::future<Outcome> beside = Request(channel, 2, absl::OkStatus(), other.get_token());
  for (int i = 0; i < 2000 && server.held() < 2; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(server.held(), 2);
  stop.request_stop();
  const Outcome cut = Finished(held);  // not the 60 s the channel's timeout allows
  EXPECT_FALSE(cut.version.ok());
  EXPECT_EQ(beside.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  std::stop_source early;
  early.request_stop();
  std::future<Outcome> never = Request(channel, 3, absl::OkStatus(), early.get_token());
  EXPECT_TRUE(absl::IsCancelled(Finished(never).version.status()));
  EXPECT_EQ(server.held(), 2);
  other.request_stop();
  EXPECT_FALSE(Finished(beside).version.ok());
}

// A stop that closes only what its request sends (StopCut::kSend, for requests whose
// bytes the server moves itself) lets the request end when the server says so: one the
// server was working on reads the server's answer, one the server drops when it sees the
// close (a CUDA IPC gather that waited for its version) ends with the server's close; a
// request stopped before it was sent is never sent.
TEST(DataChannelTest, AStopThatClosesTheSendingSideEndsWithTheServersAnswerOrClose) {
  EchoDataServer answering(/*answers_per_connection=*/0, Echo::kAnswerOnClose);
  EchoDataServer dropping(/*answers_per_connection=*/0, Echo::kHold);
  DataChannel answered_channel(answering.session(), nullptr, 1, absl::Seconds(60));
  DataChannel dropped_channel(dropping.session(), nullptr, 1, absl::Seconds(60));
  std::stop_source stop;
  std::future<Outcome> answered = Request(answered_channel, 1, absl::OkStatus(), stop.get_token(), StopCut::kSend);
  std::future<Outcome> dropped = Request(dropped_channel, 2, absl::OkStatus(), stop.get_token(), StopCut::kSend);
  for (int i = 0; i < 2000 && answering.held() + dropping.held() < 2; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(answering.held() + dropping.held(), 2);
  EXPECT_EQ(answered.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  stop.request_stop();
  EXPECT_EQ(Finished(answered).version.value_or(-1), 1);             // the answer, not the stop
  const absl::StatusOr<int64_t> closed = Finished(dropped).version;  // not the 60 s timeout
  EXPECT_TRUE(absl::IsUnavailable(closed.status())) << closed.status();
  std::future<Outcome> never = Request(answered_channel, 3, absl::OkStatus(), stop.get_token(), StopCut::kSend);
  EXPECT_FALSE(Finished(never).version.ok());
  EXPECT_EQ(answering.held(), 1);
}

// A stop, and Cancel, reach a request whose connection is still being opened: the
// server (hung) took the connection but never answers its hello, and the request ends at
// once rather than at the channel's timeout.
TEST(DataChannelTest, AStopOrCancelEndsARequestWhoseConnectionIsBeingOpened) {
  EchoDataServer server(/*answers_per_connection=*/0, Echo::kHoldHello);
  DataChannel channel(server.session(), nullptr, 2, absl::Seconds(60));
  std::stop_source stop;
  std::future<Outcome> stopped = Request(channel, 1, absl::OkStatus(), stop.get_token());
  std::future<Outcome> cancelled = Request(channel, 2);
  for (int i = 0; i < 2000 && server.held() < 2; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(server.held(), 2);  // both hellos sent, neither answered
  stop.request_stop();
  const absl::StatusOr<int64_t> cut = Finished(stopped).version;  // not the 60 s timeout
  EXPECT_TRUE(absl::IsCancelled(cut.status())) << cut.status();
  EXPECT_EQ(cancelled.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  channel.Cancel();
  const absl::StatusOr<int64_t> dropped = Finished(cancelled).version;
  EXPECT_TRUE(absl::IsCancelled(dropped.status())) << dropped.status();
}

// A stop reaches a session renewal too: nothing answers at the channel's data address
// any more, and the renewal (an OpenSession call to a server that stopped answering)
// waits until it is stopped, up to 30 s.
TEST(DataChannelTest, AStopEndsARequestWaitingForASessionRenewal) {
  const absl::StatusOr<std::vector<int>> ports = transport::PickFreeLoopbackPorts(1);
  ASSERT_TRUE(ports.ok()) << ports.status();
  std::atomic<int> renewals = 0;
  DataChannel channel(
      {absl::StrCat("127.0.0.1:", (*ports)[0]), "token"},
      [&](std::stop_token stop) -> absl::StatusOr<DataSession> {
        ++renewals;
        for (int i = 0; i < 600 && !stop.stop_requested(); ++i) absl::SleepFor(absl::Milliseconds(50));
        return absl::CancelledError("the renewal was stopped");
      },
      1, absl::Seconds(60));
  std::stop_source stop;
  std::future<Outcome> renewing = Request(channel, 1, absl::OkStatus(), stop.get_token());
  for (int i = 0; i < 2000 && renewals.load() < 1; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(renewals.load(), 1);
  stop.request_stop();
  const absl::StatusOr<int64_t> cut = Finished(renewing).version;  // not the renewal's 30 s
  EXPECT_TRUE(absl::IsCancelled(cut.status())) << cut.status();
}

}  // namespace
}  // namespace flatshard::client_internal
