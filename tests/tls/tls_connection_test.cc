// TLS connections of the data plane (tls/tls_connection.h) over loopback TCP with the test
// certificates: bytes cross both ways intact whatever the buffers' sizes; a client
// refuses a server of another CA or of another name, a server asking for client
// certificates refuses clients without one of its CAs, each with a status naming why;
// timeouts, Shutdown, CloseSend and PeerClosed behave as over TCP; answers are held while
// the peer's next request is read ahead and go out before the holder waits for the peer;
// a write to a peer that went away fails rather than raising SIGPIPE.
#include "tls/tls_connection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/ioctl.h>

#include <algorithm>
#include <cstdint>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "tests/tls/certificates_dir.h"
#include "tests/transport/held_answers.h"
#include "tests/transport/random_bytes.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::tls {
namespace {

using ::testing::HasSubstr;
using transport::Connection;
using testing::Bytes;
using testing::ExpectHeldAnswersGoOutBeforeTheHolderWaits;
using testing::ExpectReceivedInOrder;
using testing::RandomBytes;

class TlsConnectionTest : public testing::CertificatesDir {
 protected:
  struct Pair {
    std::unique_ptr<Connection> client;
    std::unique_ptr<Connection> server;
    int client_socket = -1;  // the TCP sockets underneath, which each side's TLS owns
    int server_socket = -1;
  };

  // Bytes the socket holds that nobody has read yet.
  static int UnreadIn(int socket) {
    int unread = -1;
    EXPECT_EQ(ioctl(socket, FIONREAD, &unread), 0);
    return unread;
  }
  // Waits until `socket` holds unread bytes and no more arrive for 20 ms (loopback hands
  // a sent record over at once).
  static void AwaitArrived(int socket) {
    int seen = 0;
    for (int now; (now = UnreadIn(socket)) == 0 || now != seen;) {
      seen = now;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // A TCP pair on loopback, the server's side presenting server.pem (asking for a client
  // certificate of `client_ca` unless empty), the client's trusting `ca` and presenting
  // `identity`.pem unless empty, expecting the name `host`. Nothing has crossed yet: the
  // handshake comes with the first Send or Recv.
  Pair Connected(const std::string& ca = "ca.pem", const std::string& identity = "",
                 const std::string& client_ca = "", const std::string& host = "127.0.0.1") {
    Pair pair;
    auto listener = transport::ListenTcp("127.0.0.1", 0);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return pair;
    auto tcp_client = transport::ConnectTcp("127.0.0.1", (*listener)->port(), absl::Seconds(5));
    auto tcp_server = (*listener)->Accept();
    EXPECT_TRUE(tcp_client.ok() && tcp_server.ok());
    if (!tcp_client.ok() || !tcp_server.ok()) return pair;
    pair.client_socket = transport::SocketOf(**tcp_client);
    pair.server_socket = transport::SocketOf(**tcp_server);
    for (Connection* conn : {tcp_client->get(), tcp_server->get()}) {
      EXPECT_TRUE(conn->SetTimeout(absl::Seconds(20)).ok());
    }
    auto server_context = ServerContext(Read("server.pem"), "server.pem", Read("server.key"), "server.key",
                                        client_ca.empty() ? "" : Read(client_ca), client_ca);
    auto client_context = ClientContext(Read(ca), identity.empty() ? "" : Read(identity + ".pem"),
                                        identity.empty() ? "" : Read(identity + ".key"), "the test");
    EXPECT_TRUE(server_context.ok()) << server_context.status();
    EXPECT_TRUE(client_context.ok()) << client_context.status();
    if (!server_context.ok() || !client_context.ok()) return pair;
    auto server = ServerSide(*std::move(tcp_server), *server_context);
    auto client = ClientSide(*std::move(tcp_client), *client_context, host);
    EXPECT_TRUE(server.ok() && client.ok());
    if (server.ok()) pair.server = *std::move(server);
    if (client.ok()) pair.client = *std::move(client);
    return pair;
  }

  // The client sends 4 bytes and the server receives them (both handshake meanwhile):
  // the client's status and the server's.
  static std::pair<absl::Status, absl::Status> Exchange(Pair& pair) {
    auto received = std::async(std::launch::async, [&] {
      std::vector<uint8_t> got(4);
      return pair.server->Recv(Bytes(got));
    });
    absl::Status sent = pair.client->Send({Bytes(std::vector<uint8_t>{1, 2, 3, 4})});
    // A client whose handshake failed has closed nothing yet: end the server's wait.
    if (!sent.ok()) pair.client->Shutdown();
    absl::Status got = received.get();
    return {sent, got};
  }
};

TEST_F(TlsConnectionTest, BytesCrossBothWaysIntactWhateverTheBuffersSizes) {
  Pair pair = Connected();
  ASSERT_NE(pair.client, nullptr);
  const std::vector<uint8_t> head = RandomBytes(40, 1), big = RandomBytes((9 << 20) + 7, 2), tail = RandomBytes(3, 3),
                             middling = RandomBytes(20000, 4);
  auto sent = std::async(std::launch::async, [&] {
    absl::Status status = pair.client->Send({Bytes(head), Bytes(big), {}, Bytes(tail)});
    if (status.ok()) status = pair.client->Send({Bytes(middling), Bytes(head)});
    return status;
  });
  std::vector<uint8_t> got(head.size() + big.size() + tail.size() + middling.size() + head.size());
  // Received in pieces that do not follow the sender's.
  for (size_t at = 0, piece = 1; at < got.size(); at += piece, piece = piece * 3 + 1) {
    piece = std::min(piece, got.size() - at);
    ASSERT_TRUE(pair.server->Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(got.data()) + at, piece)).ok());
  }
  ASSERT_TRUE(sent.get().ok());
  std::vector<uint8_t> expected = head;
  for (const auto* part : {&big, &tail, &middling, &head}) expected.insert(expected.end(), part->begin(), part->end());
  EXPECT_TRUE(got == expected) << "the bytes changed on their way";
  // And back.
  const std::vector<uint8_t> answer = RandomBytes(1 << 20, 5);
  auto answered = std::async(std::launch::async, [&] { return pair.server->Send({Bytes(answer)}); });
  std::vector<uint8_t> back(answer.size());
  ASSERT_TRUE(pair.client->Recv(Bytes(back)).ok());
  ASSERT_TRUE(answered.get().ok());
  EXPECT_TRUE(back == answer);
  EXPECT_THAT(pair.client->peer(), HasSubstr("127.0.0.1:"));
}

TEST_F(TlsConnectionTest, AClientRefusesAServerOfAnotherCaOrName) {
  {
    Pair pair = Connected("other-ca.pem");
    ASSERT_NE(pair.client, nullptr);
    const auto [sent, received] = Exchange(pair);
    EXPECT_TRUE(absl::IsUnavailable(sent)) << sent;
    EXPECT_THAT(std::string(sent.message()), HasSubstr("TLS handshake with 127.0.0.1:"));
    EXPECT_THAT(std::string(sent.message()), HasSubstr("certificate verify failed"));
    EXPECT_FALSE(received.ok());
  }
  {
    Pair pair = Connected("ca.pem", "", "", "127.0.0.2");  // server.pem names 127.0.0.1 and localhost
    ASSERT_NE(pair.client, nullptr);
    const auto [sent, received] = Exchange(pair);
    EXPECT_THAT(std::string(sent.message()), HasSubstr("certificate verify failed: IP address mismatch")) << sent;
  }
  {
    Pair pair = Connected("ca.pem", "", "", "flatshard-0.flatshard");
    ASSERT_NE(pair.client, nullptr);
    const auto [sent, received] = Exchange(pair);
    EXPECT_THAT(std::string(sent.message()), HasSubstr("certificate verify failed: hostname mismatch")) << sent;
  }
  Pair by_name = Connected("ca.pem", "", "", "localhost");
  ASSERT_NE(by_name.client, nullptr);
  const auto [sent, received] = Exchange(by_name);
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(received.ok()) << received;
}

TEST_F(TlsConnectionTest, AServerAskingForClientCertificatesTakesOnlyThoseOfItsCas) {
  for (const char* refused : {"", "other-client", "server-only"}) {
    SCOPED_TRACE(absl::StrCat("presenting '", refused, "'"));
    Pair pair = Connected("ca.pem", refused, "ca.pem");
    ASSERT_NE(pair.client, nullptr);
    const auto [sent, received] = Exchange(pair);
    EXPECT_TRUE(absl::IsUnavailable(received)) << received;
    EXPECT_THAT(std::string(received.message()), HasSubstr("TLS handshake with 127.0.0.1:"));
  }
  Pair pair = Connected("ca.pem", "client", "ca.pem");
  ASSERT_NE(pair.client, nullptr);
  const auto [sent, received] = Exchange(pair);
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(received.ok()) << received;
}

TEST_F(TlsConnectionTest, TimeoutsShutdownCloseSendAndPeerClosedActAsOverTcp) {
  Pair pair = Connected();
  ASSERT_NE(pair.client, nullptr);
  const auto [sent, received] = Exchange(pair);
  ASSERT_TRUE(sent.ok() && received.ok());
  EXPECT_FALSE(pair.server->PeerClosed());
  EXPECT_FALSE(pair.client->PeerClosed()) << "no session ticket or other record crosses an idle connection";
  EXPECT_FALSE(pair.client->PollReadable(absl::Milliseconds(20)));
  EXPECT_FALSE(pair.client->WaitReadable(absl::Milliseconds(20)));

  std::vector<uint8_t> one(1);
  ASSERT_TRUE(pair.server->SetTimeout(absl::Milliseconds(200)).ok());
  const absl::Time start = absl::Now();
  const absl::Status timed_out = pair.server->Recv(Bytes(one));
  EXPECT_TRUE(absl::IsDeadlineExceeded(timed_out)) << timed_out;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  // CloseSend: the server reads the end of the stream, and may still answer.
  pair.client->CloseSend();
  ASSERT_TRUE(pair.server->SetTimeout(absl::Seconds(20)).ok());
  const absl::Status closed = pair.server->Recv(Bytes(one));
  EXPECT_TRUE(absl::IsUnavailable(closed)) << closed;
  EXPECT_THAT(std::string(closed.message()), HasSubstr("closed the connection"));
  EXPECT_TRUE(pair.server->PeerClosed());
  ASSERT_TRUE(pair.server->Send({Bytes(std::vector<uint8_t>{42})}).ok());
  EXPECT_TRUE(pair.client->PollReadable(absl::Seconds(5)));
  EXPECT_TRUE(pair.client->WaitReadable(absl::Seconds(5)));
  ASSERT_TRUE(pair.client->Recv(Bytes(one)).ok());
  EXPECT_EQ(one[0], 42);
  // Two records on the socket: the first read takes both in (read ahead), and the waits
  // count the second, which the socket no longer holds.
  ASSERT_TRUE(pair.server->Send({Bytes(std::vector<uint8_t>{43})}).ok());
  ASSERT_TRUE(pair.server->Send({Bytes(std::vector<uint8_t>{44})}).ok());
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(pair.client->Recv(Bytes(one)).ok());
  EXPECT_EQ(one[0], 43);
  EXPECT_TRUE(pair.client->WaitReadable(absl::Milliseconds(20)));
  EXPECT_TRUE(pair.client->PollReadable(absl::ZeroDuration()));
  ASSERT_TRUE(pair.client->Recv(Bytes(one)).ok());
  EXPECT_EQ(one[0], 44);
  EXPECT_FALSE(pair.client->WaitReadable(absl::Milliseconds(20)));

  // Shutdown from another thread ends a Recv waiting on it.
  auto waiting = std::async(std::launch::async, [&] { return pair.client->Recv(Bytes(one)); });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  pair.client->Shutdown();
  EXPECT_EQ(waiting.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_FALSE(waiting.get().ok());
}

// While the peer's next request is read ahead, in a whole record or part of one, a
// server's answers wait in the write buffer (SendOrHold) and leave together once nothing
// more is read ahead, in order; a Recv that what was read ahead satisfies sends nothing.
TEST_F(TlsConnectionTest, AnswersWaitWhileTheNextRequestIsReadAheadAndLeaveTogether) {
  Pair pair = Connected();
  ASSERT_NE(pair.client, nullptr);
  ASSERT_TRUE(Exchange(pair).first.ok());  // the handshake
  const std::vector<uint8_t> one = RandomBytes(16, 40), two = RandomBytes(2 * 16, 41);
  ASSERT_TRUE(pair.client->Send({Bytes(one)}).ok());  // a record
  ASSERT_TRUE(pair.client->Send({Bytes(two)}).ok());  // and another, of two requests
  AwaitArrived(pair.server_socket);
  const std::vector<uint8_t> a = RandomBytes(40, 42), b = RandomBytes(20000, 43), c = RandomBytes(8, 44);
  std::vector<uint8_t> request(16);
  ASSERT_TRUE(pair.server->Recv(Bytes(request)).ok());  // both records are read ahead
  EXPECT_EQ(request, one);
  ASSERT_TRUE(pair.server->SendOrHold({Bytes(a)}).ok());
  ASSERT_TRUE(pair.server->Recv(Bytes(request)).ok());  // from the second record
  ASSERT_TRUE(pair.server->SendOrHold({Bytes(b)}).ok());
  ASSERT_TRUE(pair.server->Recv(Bytes(request)).ok());  // the rest of it: nothing is read ahead now
  EXPECT_TRUE(std::equal(request.begin(), request.end(), two.begin() + 16));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(UnreadIn(pair.client_socket), 0) << "an answer left while the next request waited";
  ASSERT_TRUE(pair.server->SendOrHold({Bytes(c)}).ok());
  ExpectReceivedInOrder(*pair.client, {a, b, c});
}

// As over TCP (tests/transport/held_answers.h): held answers go out before the holder
// waits to read from the peer (a Recv that needs the rest of a record read in part,
// WaitReadable, PollReadable), with SendHeld, Send or a SendOrHold past what may be
// held, and stay held while it reads records it read ahead.
TEST_F(TlsConnectionTest, HeldAnswersGoOutBeforeTheHolderWaitsForThePeer) {
  Pair pair = Connected();
  ASSERT_NE(pair.client, nullptr);
  ASSERT_TRUE(Exchange(pair).first.ok());  // the handshake
  ExpectHeldAnswersGoOutBeforeTheHolderWaits(
      *pair.server, *pair.client, [&] { AwaitArrived(pair.server_socket); },
      [&] { return UnreadIn(pair.client_socket); });
}

TEST_F(TlsConnectionTest, WritingToAPeerThatWentAwayFailsWithoutSigpipe) {
  Pair pair = Connected();
  ASSERT_NE(pair.client, nullptr);
  ASSERT_TRUE(Exchange(pair).first.ok());
  pair.server.reset();
  const std::vector<uint8_t> big = RandomBytes(8 << 20, 6);
  absl::Status sent;
  for (int i = 0; i < 10 && sent.ok(); ++i) sent = pair.client->Send({Bytes(big)});
  EXPECT_TRUE(absl::IsUnavailable(sent)) << sent;  // and the process is still here
}

TEST_F(TlsConnectionTest, APlaintextPeerAndBadArgumentsAreRefused) {
  auto listener = transport::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok());
  auto plain = transport::ConnectTcp("127.0.0.1", (*listener)->port(), absl::Seconds(5));
  auto accepted = (*listener)->Accept();
  ASSERT_TRUE(plain.ok() && accepted.ok());
  ASSERT_TRUE((*accepted)->SetTimeout(absl::Seconds(20)).ok());
  auto context = ServerContext(Read("server.pem"), "server.pem", Read("server.key"), "server.key");
  ASSERT_TRUE(context.ok()) << context.status();
  auto server = ServerSide(*std::move(accepted), *context);
  ASSERT_TRUE(server.ok());
  const std::string hello = "GET / HTTP/1.0\r\n\r\n";
  const auto hello_bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(hello.data()), hello.size());
  ASSERT_TRUE((*plain)->Send({hello_bytes}).ok());
  std::vector<uint8_t> got(4);
  const absl::Status refused = (*server)->Recv(Bytes(got));
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("TLS handshake with 127.0.0.1:"));

  EXPECT_EQ(ServerContext(Read("server.pem"), "server.pem", Read("ca.key"), "ca.key").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerContext(Read("server.pem"), "server.pem", Read("server.key"), "server.key", "no CA", "bundle")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ClientContext("no CA", "", "", "the test").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flatshard::tls
