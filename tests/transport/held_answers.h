// The checks of held answers (Connection::SendOrHold) that every transport that holds
// them passes alike, plain TCP (tcp_transport_test.cc) and TLS (tls_connection_test.cc):
// ExpectHeldAnswersGoOutBeforeTheHolderWaits, and ExpectReceivedInOrder for the bytes.
#ifndef FLATSHARD_TESTS_TRANSPORT_HELD_ANSWERS_H_
#define FLATSHARD_TESTS_TRANSPORT_HELD_ANSWERS_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "tests/transport/random_bytes.h"
#include "transport/transport.h"

namespace flatshard::testing {

// Receives the concatenation of `parts` on `conn` and expects exactly them, in order.
inline void ExpectReceivedInOrder(transport::Connection& conn, const std::vector<std::vector<uint8_t>>& parts) {
  std::vector<uint8_t> expected;
  for (const std::vector<uint8_t>& part : parts) expected.insert(expected.end(), part.begin(), part.end());
  std::vector<uint8_t> got(expected.size());
  ASSERT_TRUE(conn.Recv(Bytes(got)).ok());
  EXPECT_TRUE(got == expected) << "not the bytes sent, in their order";
}

// Held answers go out before the holder waits to read from the peer, which may be
// waiting for them before it sends more: a Recv that needs what the peer has not sent
// yet, WaitReadable, PollReadable; and with SendHeld, or before the bytes of a Send or of
// a SendOrHold past the 64 KiB held at most, in order. While the holder reads only what
// it read ahead, they stay held. `client` sends, `server` holds; `await_arrived()` waits
// until a request and the next one that `client` sent together are on `server`'s socket,
// and `unread_by_client()` counts the bytes on the client's socket that nobody has read.
inline void ExpectHeldAnswersGoOutBeforeTheHolderWaits(transport::Connection& server, transport::Connection& client,
                                                       const std::function<void()>& await_arrived,
                                                       const std::function<int()>& unread_by_client) {
  ASSERT_TRUE(server.SetTimeout(absl::Seconds(5)).ok());
  const std::vector<uint8_t> answer = RandomBytes(24, 35);
  std::vector<uint8_t> request(16);
  {
    // The peer sends a request and the first half of the next, and the rest only once it
    // has the answer; nothing else arrives: without the answer both sides would wait.
    const std::vector<uint8_t> first = RandomBytes(16 + 8, 36), rest = RandomBytes(8, 37);
    std::vector<uint8_t> got(answer.size()), next(16);
    std::thread peer([&] {
      EXPECT_TRUE(client.Send({Bytes(first)}).ok());
      EXPECT_TRUE(client.Recv(Bytes(got)).ok());
      EXPECT_TRUE(client.Send({Bytes(rest)}).ok());
    });
    const absl::Status received = [&] {
      FLATSHARD_RETURN_IF_ERROR(server.Recv(Bytes(request)));
      while (!server.PollReadable(absl::ZeroDuration())) absl::SleepFor(absl::Milliseconds(1));  // the half
      FLATSHARD_RETURN_IF_ERROR(server.SendOrHold({Bytes(answer)}));
      return server.Recv(Bytes(next));
    }();
    if (!received.ok()) client.Shutdown();  // the peer may still wait for the answer
    peer.join();
    ASSERT_TRUE(received.ok()) << received;
    EXPECT_EQ(got, answer);
  }
  const std::vector<uint8_t> ahead = RandomBytes(16 + 16, 38);
  for (const absl::string_view then : {"WaitReadable", "PollReadable", "SendHeld", "Send", "a large SendOrHold"}) {
    SCOPED_TRACE(then);
    ASSERT_TRUE(client.Send({Bytes(ahead)}).ok());
    await_arrived();
    ASSERT_TRUE(server.Recv(Bytes(request)).ok());
    ASSERT_TRUE(server.SendOrHold({Bytes(answer)}).ok());
    const bool large = then == "a large SendOrHold";
    const std::vector<uint8_t> after = RandomBytes(large ? 100000 : 8, 39);  // past the 64 KiB held at most
    std::vector<std::vector<uint8_t>> expected = {answer};  // the held answer first
    if (large) {  // while the next request is still read ahead
      ASSERT_TRUE(server.SendOrHold({Bytes(after)}).ok());
      expected.push_back(after);
    }
    ASSERT_TRUE(server.Recv(Bytes(request)).ok());  // all that was read ahead: the socket is not read
    if (!large) {
      absl::SleepFor(absl::Milliseconds(20));
      EXPECT_EQ(unread_by_client(), 0) << "the answer left while the holder read what it had read ahead";
      if (then == "WaitReadable") {
        EXPECT_FALSE(server.WaitReadable(absl::Milliseconds(10)));
      } else if (then == "PollReadable") {
        EXPECT_FALSE(server.PollReadable(absl::Milliseconds(10)));
      } else if (then == "SendHeld") {
        ASSERT_TRUE(server.SendHeld().ok());
      } else {
        ASSERT_TRUE(server.Send({Bytes(after)}).ok());
        expected.push_back(after);
      }
    }
    ExpectReceivedInOrder(client, expected);
  }
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_TRANSPORT_HELD_ANSWERS_H_
