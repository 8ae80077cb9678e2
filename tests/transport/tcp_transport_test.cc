#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <random>
#include <set>
#include <stop_token>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "tests/transport/held_answers.h"
#include "tests/transport/random_bytes.h"

namespace flatshard::transport {
namespace {

using ::testing::HasSubstr;
using testing::Bytes;
using testing::ExpectHeldAnswersGoOutBeforeTheHolderWaits;
using testing::ExpectReceivedInOrder;
using testing::RandomBytes;

// A connected loopback pair: `client` from ConnectTcp, `server` from the listener.
struct Pair {
  std::unique_ptr<Listener> listener;
  std::unique_ptr<Connection> client;
  std::unique_ptr<Connection> server;
};

Pair Connected() {
  Pair pair;
  auto listener = ListenTcp("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return pair;
  pair.listener = *std::move(listener);
  auto client = ConnectTcp("127.0.0.1", pair.listener->port(), absl::Seconds(5));
  EXPECT_TRUE(client.ok()) << client.status();
  auto server = pair.listener->Accept();
  EXPECT_TRUE(server.ok()) << server.status();
  if (client.ok()) pair.client = *std::move(client);
  if (server.ok()) pair.server = *std::move(server);
  for (Connection* conn : {pair.client.get(), pair.server.get()}) {
    if (conn != nullptr) {
      EXPECT_TRUE(conn->SetTimeout(absl::Seconds(30)).ok());
    }
  }
  return pair;
}

TEST(TcpTransportTest, ListenerOnPortZeroGetsAPortAndPeersAreNamed) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  ASSERT_NE(pair.client, nullptr);
  EXPECT_GT(pair.listener->port(), 0);
  EXPECT_EQ(pair.client->peer(), absl::StrCat("127.0.0.1:", pair.listener->port()));
  EXPECT_THAT(pair.server->peer(), HasSubstr("127.0.0.1:"));
  EXPECT_NE(pair.server->peer(), pair.client->peer());
}

TEST(TcpTransportTest, SendGathersBuffersInOrderAndSkipsEmptyOnes) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const std::vector<uint8_t> a = RandomBytes(3, 1), b, c = RandomBytes(70000, 2);
  ASSERT_TRUE(pair.client->Send({Bytes(a), Bytes(b), Bytes(c)}).ok());
  std::vector<uint8_t> got(a.size() + c.size());
  ASSERT_TRUE(pair.server->Recv(Bytes(got)).ok());
  std::vector<uint8_t> want = a;
  want.insert(want.end(), c.begin(), c.end());
  EXPECT_EQ(got, want);
}

// Larger than any socket buffer, in both directions at once (one sender and one receiver
// per connection at a time, as the interface allows), so partial sends are exercised.
TEST(TcpTransportTest, LargeTransfersArriveIntactInBothDirectionsAtOnce) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const size_t size = 48 << 20;
  const std::vector<uint8_t> up = RandomBytes(size, 3), down = RandomBytes(size, 4);
  const size_t head = 1 << 20;  // two buffers: the split lands inside a sendmsg
  absl::Status up_sent, down_sent;
  std::thread client_sender([&] {
    up_sent = pair.client->Send({Bytes(up).subspan(0, head), Bytes(up).subspan(head)});
  });
  std::thread server_sender([&] {
    down_sent = pair.server->Send({Bytes(down).subspan(0, head), Bytes(down).subspan(head)});
  });
  std::vector<uint8_t> up_got(size), down_got(size);
  absl::Status down_received;
  std::thread client_receiver([&] { down_received = pair.client->Recv(Bytes(down_got)); });
  const absl::Status up_received = pair.server->Recv(Bytes(up_got));
  client_sender.join();
  server_sender.join();
  client_receiver.join();
  ASSERT_TRUE(up_sent.ok()) << up_sent;
  ASSERT_TRUE(down_sent.ok()) << down_sent;
  ASSERT_TRUE(up_received.ok()) << up_received;
  ASSERT_TRUE(down_received.ok()) << down_received;
  EXPECT_TRUE(up_got == up);
  EXPECT_TRUE(down_got == down);
}

// Bytes the kernel holds for `conn`'s socket, not yet read by the process.
int UnreadInSocket(const Connection& conn) {
  int unread = -1;
  EXPECT_EQ(ioctl(SocketOf(conn), FIONREAD, &unread), 0);
  return unread;
}

// A pipeline's small messages, sent together: the first small Recv takes all of them
// from the socket at once, and the next ones come from what it read ahead, in order.
TEST(TcpTransportTest, SmallReceivesReadAheadWhatTheSocketHolds) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const std::vector<uint8_t> a = RandomBytes(40, 21), b = RandomBytes(4096, 22), c = RandomBytes(9, 23);
  ASSERT_TRUE(pair.client->Send({Bytes(a), Bytes(b), Bytes(c)}).ok());
  while (UnreadInSocket(*pair.server) < static_cast<int>(a.size() + b.size() + c.size())) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  std::vector<uint8_t> got_a(a.size()), got_b(b.size()), got_c(c.size());
  ASSERT_TRUE(pair.server->Recv(Bytes(got_a)).ok());
  EXPECT_EQ(UnreadInSocket(*pair.server), 0);  // the rest was read ahead...
  EXPECT_TRUE(pair.server->PollReadable(absl::ZeroDuration()));  // ...and counts as readable
  EXPECT_TRUE(pair.server->WaitReadable(absl::ZeroDuration()));
  ASSERT_TRUE(pair.server->Recv(Bytes(got_b)).ok());
  ASSERT_TRUE(pair.server->Recv(Bytes(got_c)).ok());
  EXPECT_EQ(got_a, a);
  EXPECT_EQ(got_b, b);
  EXPECT_EQ(got_c, c);
  EXPECT_FALSE(pair.server->PollReadable(absl::ZeroDuration()));  // all taken
}

// A large Recv takes what a small one read ahead of it, then the rest straight from the
// socket; a small one after it reads ahead again.
TEST(TcpTransportTest, ALargeReceiveAfterASmallOneGetsEveryByteInOrder) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const std::vector<uint8_t> head = RandomBytes(24, 24), body = RandomBytes(3 << 20, 25), tail = RandomBytes(7, 26);
  std::thread sender([&] { EXPECT_TRUE(pair.client->Send({Bytes(head), Bytes(body), Bytes(tail)}).ok()); });
  std::vector<uint8_t> got_head(head.size()), got_body(body.size()), got_tail(tail.size());
  ASSERT_TRUE(pair.server->Recv(Bytes(got_head)).ok());
  ASSERT_TRUE(pair.server->Recv(Bytes(got_body)).ok());
  ASSERT_TRUE(pair.server->Recv(Bytes(got_tail)).ok());
  sender.join();
  EXPECT_EQ(got_head, head);
  EXPECT_TRUE(got_body == body);
  EXPECT_EQ(got_tail, tail);
}

// After Shutdown every Recv fails: bytes read ahead (or still queued in the socket) are
// not handed out.
TEST(TcpTransportTest, AfterShutdownARecvFailsThoughBytesWereReadAhead) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const std::vector<uint8_t> sent = RandomBytes(20, 27);
  ASSERT_TRUE(pair.client->Send({Bytes(sent)}).ok());
  while (UnreadInSocket(*pair.server) < static_cast<int>(sent.size())) absl::SleepFor(absl::Milliseconds(1));
  std::vector<uint8_t> half(10);
  ASSERT_TRUE(pair.server->Recv(Bytes(half)).ok());
  pair.server->Shutdown();
  EXPECT_FALSE(pair.server->Recv(Bytes(half)).ok());
}

// While the peer's next request is already read ahead, a server's answers wait in the
// connection (SendOrHold) and leave together with the answer given once nothing more is
// read ahead, in order.
TEST(TcpTransportTest, AnswersWaitWhileTheNextRequestIsReadAheadAndLeaveTogether) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const std::vector<uint8_t> requests = RandomBytes(3 * 16, 31);
  ASSERT_TRUE(pair.client->Send({Bytes(requests)}).ok());
  while (UnreadInSocket(*pair.server) < static_cast<int>(requests.size())) absl::SleepFor(absl::Milliseconds(1));
  const std::vector<uint8_t> a = RandomBytes(40, 32), b = RandomBytes(3000, 33), c = RandomBytes(8, 34);
  std::vector<uint8_t> request(16);
  ASSERT_TRUE(pair.server->Recv(Bytes(request)).ok());  // the other two are read ahead
  ASSERT_TRUE(pair.server->SendOrHold({Bytes(a)}).ok());
  ASSERT_TRUE(pair.server->Recv(Bytes(request)).ok());
  ASSERT_TRUE(pair.server->SendOrHold({Bytes(b)}).ok());
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(UnreadInSocket(*pair.client), 0) << "an answer left while the next request waited";
  ASSERT_TRUE(pair.server->Recv(Bytes(request)).ok());  // the last one: nothing is read ahead now
  ASSERT_TRUE(pair.server->SendOrHold({Bytes(c)}).ok());
  ExpectReceivedInOrder(*pair.client, {a, b, c});
}

// Held answers go out before the holder waits to read from the peer (a Recv that needs
// the socket, WaitReadable, PollReadable), with SendHeld, Send or a SendOrHold past what
// may be held, and stay held while it reads what it read ahead (held_answers.h).
TEST(TcpTransportTest, HeldAnswersGoOutBeforeTheHolderWaitsForThePeer) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  ExpectHeldAnswersGoOutBeforeTheHolderWaits(
      *pair.server, *pair.client,
      [&] {
        while (UnreadInSocket(*pair.server) < 16 + 16) absl::SleepFor(absl::Milliseconds(1));
      },
      [&] { return UnreadInSocket(*pair.client); });
}

TEST(TcpTransportTest, RecvNamesHowManyBytesArrivedBeforeThePeerClosed) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  ASSERT_TRUE(pair.client->Send({Bytes(RandomBytes(10, 5))}).ok());
  pair.client.reset();
  std::vector<uint8_t> buffer(100);
  const absl::Status status = pair.server->Recv(Bytes(buffer));
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("after 10 of 100 bytes"));
}

TEST(TcpTransportTest, RecvTimesOutWhenNothingArrives) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  ASSERT_TRUE(pair.server->SetTimeout(absl::Milliseconds(50)).ok());
  std::vector<uint8_t> buffer(8);
  const absl::Status status = pair.server->Recv(Bytes(buffer));
  EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
}

TEST(TcpTransportTest, SendTimesOutWhenThePeerStopsReading) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  ASSERT_TRUE(pair.client->SetTimeout(absl::Milliseconds(100)).ok());
  // Far more than loopback's socket buffers can absorb while nobody reads.
  const std::vector<uint8_t> data(256 << 20);
  const absl::Status status = pair.client->Send({Bytes(data)});
  EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
}

TEST(TcpTransportTest, SendToAClosedPeerIsUnavailable) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  pair.server.reset();
  const std::vector<uint8_t> data(1 << 20);
  absl::Status status;
  // The first send may still land in the socket buffer; the reset arrives soon after.
  for (int i = 0; i < 100 && status.ok(); ++i) status = pair.client->Send({Bytes(data)});
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

TEST(TcpTransportTest, TimeoutsMustBePositive) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(pair.server->SetTimeout(absl::ZeroDuration())));
  EXPECT_TRUE(absl::IsInvalidArgument(pair.server->SetTimeout(absl::Seconds(-1))));
  EXPECT_TRUE(pair.server->SetTimeout(absl::InfiniteDuration()).ok());
  // Below the kernel's microsecond resolution still times out rather than meaning "never".
  ASSERT_TRUE(pair.server->SetTimeout(absl::Nanoseconds(1)).ok());
  std::vector<uint8_t> buffer(8);
  EXPECT_TRUE(absl::IsDeadlineExceeded(pair.server->Recv(Bytes(buffer))));
}

TEST(TcpTransportTest, ShutdownUnblocksARecvOnAnotherThread) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  ASSERT_TRUE(pair.server->SetTimeout(absl::InfiniteDuration()).ok());
  absl::Status status;
  std::thread receiver([&] {
    std::vector<uint8_t> buffer(8);
    status = pair.server->Recv(Bytes(buffer));
  });
  absl::SleepFor(absl::Milliseconds(50));  // usually blocked by now; either order must work
  pair.server->Shutdown();
  receiver.join();
  EXPECT_FALSE(status.ok());
  std::vector<uint8_t> buffer(8);
  EXPECT_FALSE(pair.server->Recv(Bytes(buffer)).ok());  // later calls fail too
}

TEST(TcpTransportTest, PeerClosedSeesAClosedPeerButNotPendingData) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  EXPECT_FALSE(pair.client->PeerClosed());
  ASSERT_TRUE(pair.server->Send({Bytes(RandomBytes(1, 12))}).ok());
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(pair.client->PeerClosed());  // a byte waits: open, and the byte stays
  std::vector<uint8_t> byte(1);
  ASSERT_TRUE(pair.client->Recv(Bytes(byte)).ok());
  pair.server.reset();
  bool closed = false;
  for (int i = 0; i < 100 && !closed; ++i) {  // the FIN crosses loopback at once
    closed = pair.client->PeerClosed();
    if (!closed) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(closed);
}

// CloseSend ends only what its side sends: the peer sees the close, and still answers
// what it read before, which arrives.
TEST(TcpTransportTest, CloseSendEndsTheStreamOneWayAndTheAnswerStillArrives) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  const std::vector<uint8_t> request = RandomBytes(64, 13);
  ASSERT_TRUE(pair.client->Send({Bytes(request)}).ok());
  pair.client->CloseSend();
  EXPECT_FALSE(pair.client->Send({Bytes(request)}).ok());  // its sends fail from now on
  std::vector<uint8_t> read(request.size());
  ASSERT_TRUE(pair.server->Recv(Bytes(read)).ok());  // what was sent before arrives
  EXPECT_EQ(read, request);
  bool closed = false;
  for (int i = 0; i < 100 && !closed; ++i) {
    closed = pair.server->PeerClosed();
    if (!closed) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(closed);
  const std::vector<uint8_t> answer = RandomBytes(1 << 20, 14);  // more than one segment
  std::thread answering([&] { EXPECT_TRUE(pair.server->Send({Bytes(answer)}).ok()); });
  std::vector<uint8_t> got(answer.size());
  EXPECT_TRUE(pair.client->Recv(Bytes(got)).ok());
  answering.join();
  EXPECT_EQ(got, answer);
  pair.server.reset();
  EXPECT_TRUE(absl::IsUnavailable(pair.client->Recv(Bytes(got))));  // then the peer's close
}

TEST(TcpTransportTest, PollReadableWaitsForBytesForAtMostItsWindow) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  // Nothing comes: false once the window has passed, not before.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(pair.client->PollReadable(absl::Milliseconds(5)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(5));
  // A byte sent while it polls: true, and the byte is still there to read.
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(2));
    ASSERT_TRUE(pair.server->Send({Bytes(RandomBytes(1, 13))}).ok());
  });
  EXPECT_TRUE(pair.client->PollReadable(absl::Seconds(10)));
  sender.join();
  std::vector<uint8_t> byte(1);
  ASSERT_TRUE(pair.client->Recv(Bytes(byte)).ok());
  EXPECT_EQ(byte, RandomBytes(1, 13));
  // A closed peer: true (the read then says so).
  pair.server.reset();
  EXPECT_TRUE(pair.client->PollReadable(absl::Seconds(10)));
  EXPECT_FALSE(pair.client->Recv(Bytes(byte)).ok());
}

TEST(TcpTransportTest, WaitReadableSleepsUntilBytesACloseAShutdownOrItsTimeout) {
  Pair pair = Connected();
  ASSERT_NE(pair.server, nullptr);
  // The Send/Recv timeout does not bound the wait, nor does the wait change it.
  ASSERT_TRUE(pair.client->SetTimeout(absl::Milliseconds(10)).ok());
  const absl::Time start = absl::Now();
  EXPECT_FALSE(pair.client->WaitReadable(absl::Milliseconds(100)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  std::vector<uint8_t> byte(1);
  EXPECT_TRUE(absl::IsDeadlineExceeded(pair.client->Recv(Bytes(byte))));
  // A byte sent while it waits: true, and the byte is still there to read.
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(pair.server->Send({Bytes(RandomBytes(1, 15))}).ok());
  });
  EXPECT_TRUE(pair.client->WaitReadable(absl::InfiniteDuration()));
  sender.join();
  ASSERT_TRUE(pair.client->Recv(Bytes(byte)).ok());
  EXPECT_EQ(byte, RandomBytes(1, 15));
  // Shutdown from another thread ends a wait with no limit (a server that stops).
  auto waiting = std::async(std::launch::async, [&] { return pair.server->WaitReadable(absl::InfiniteDuration()); });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  pair.server->Shutdown();
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_TRUE(waiting.get());
  // A closed peer: true at once (the read then says so).
  pair.server.reset();
  EXPECT_TRUE(pair.client->WaitReadable(absl::Hours(1)));
  EXPECT_FALSE(pair.client->Recv(Bytes(byte)).ok());
}

TEST(TcpTransportTest, ListenerShutdownUnblocksAccept) {
  auto listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::Status status;
  std::thread acceptor([&] { status = (*listener)->Accept().status(); });
  absl::SleepFor(absl::Milliseconds(50));
  (*listener)->Shutdown();
  acceptor.join();
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
}

// Out of descriptors, accept fails while the peer stays in the backlog and the socket
// readable: Accept pauses before it says so, so that a server's accept loop does not
// spin, and takes the peer once a descriptor is free.
TEST(TcpTransportTest, AcceptOutOfDescriptorsPausesAndThePeerWaitsInTheBacklog) {
  auto listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto client = ConnectTcp("127.0.0.1", (*listener)->port(), absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  const int lowest_free = open("/dev/null", O_RDONLY);  // the descriptor accept would get
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  rlimit lowered = limit;
  lowered.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  const absl::Time start = absl::Now();
  auto refused = (*listener)->Accept();
  const absl::Duration waited = absl::Now() - start;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("accept: Too many open files"));
  EXPECT_GE(waited, kOutOfResourcesPause);
  auto accepted = (*listener)->Accept();
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE((*client)->Send({Bytes(std::vector<uint8_t>{1, 2, 3})}).ok());
  std::vector<uint8_t> got(3);
  ASSERT_TRUE((*accepted)->Recv(Bytes(got)).ok());
  EXPECT_EQ(got, (std::vector<uint8_t>{1, 2, 3}));
}

TEST(TcpTransportTest, ConnectingToAPortNobodyListensOnIsUnavailable) {
  auto ports = PickFreeLoopbackPorts(1);
  ASSERT_TRUE(ports.ok()) << ports.status();
  auto conn = ConnectTcp("127.0.0.1", (*ports)[0], absl::Seconds(5));
  EXPECT_TRUE(absl::IsUnavailable(conn.status())) << conn.status();
  EXPECT_THAT(conn.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", (*ports)[0])));
}

// A host that does not answer (here a listener whose backlog is full: the kernel drops
// the SYNs) holds a connect for its whole timeout; a stop ends it within moments.
TEST(TcpTransportTest, AConnectNobodyAnswersEndsAtItsTimeoutOrAtOnceOnAStop) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  absl::Cleanup close_fd = [fd] { close(fd); };
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 0), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  std::vector<std::unique_ptr<Connection>> queued;  // never accepted: they fill the backlog
  for (int i = 0; i < 3; ++i) {
    auto conn = ConnectTcp("127.0.0.1", port, absl::Milliseconds(300));
    if (conn.ok()) queued.push_back(*std::move(conn));
  }
  ASSERT_FALSE(queued.empty());
  auto timed_out = ConnectTcp("127.0.0.1", port, absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(timed_out.status())) << timed_out.status();
  std::stop_source stop;
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(200));
    stop.request_stop();
  });
  const absl::Time start = absl::Now();
  auto stopped = ConnectTcp("127.0.0.1", port, absl::Seconds(60), stop.get_token());
  stopper.join();
  EXPECT_TRUE(absl::IsCancelled(stopped.status())) << stopped.status();
  EXPECT_THAT(stopped.status().message(), HasSubstr(absl::StrCat("connect to 127.0.0.1:", port, ": stopped")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(TcpTransportTest, BadAddressesAreInvalidArguments) {
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectTcp("127.0.0.1", 65536, absl::Seconds(1)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ListenTcp("::1", 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ListenTcp("", 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ListenTcp("127.0.0.1", -1).status()));
}

// Names resolve (getaddrinfo; "localhost" from /etc/hosts, so no query leaves the
// machine): a server may listen on, and a client connect to, a pod's DNS name.
TEST(TcpTransportTest, HostNamesResolveToTheirIpv4Address) {
  auto listener = ListenTcp("localhost", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto conn = ConnectTcp("localhost", (*listener)->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto accepted = (*listener)->Accept();
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  const std::string hello = "hello";
  ASSERT_TRUE(
      (*conn)->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(hello.data()), hello.size())}).ok());
  std::string got(hello.size(), '\0');
  ASSERT_TRUE((*accepted)->Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(got.data()), got.size())).ok());
  EXPECT_EQ(got, hello);
}

TEST(TcpTransportTest, BindingATakenPortIsUnavailable) {
  auto first = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ListenTcp("127.0.0.1", (*first)->port());
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("bind"));
}

TEST(TcpTransportTest, PickedPortsAreDistinctAndBindable) {
  auto ports = PickFreeLoopbackPorts(16);
  ASSERT_TRUE(ports.ok()) << ports.status();
  EXPECT_EQ(std::set<int>(ports->begin(), ports->end()).size(), 16u);
  std::vector<std::unique_ptr<Listener>> listeners;
  for (int port : *ports) {
    auto listener = ListenTcp("127.0.0.1", port);
    ASSERT_TRUE(listener.ok()) << "port " << port << ": " << listener.status();
    EXPECT_EQ((*listener)->port(), port);
    listeners.push_back(*std::move(listener));
  }
}

TEST(TcpTransportTest, SplitHostPortAcceptsHostColonPortOnly) {
  std::string host;
  int port = 0;
  ASSERT_TRUE(SplitHostPort("127.0.0.1:7070", host, port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 7070);
  ASSERT_TRUE(SplitHostPort("node-3.cluster:0", host, port).ok());
  EXPECT_EQ(host, "node-3.cluster");
  EXPECT_EQ(port, 0);
  for (const char* bad : {"", "127.0.0.1", ":7070", "host:", "host:http", "host:65536",
                          "host:-1", "host:7070x"}) {
    const absl::Status status = SplitHostPort(bad, host, port);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << "'" << bad << "': " << status;
    EXPECT_THAT(status.message(), HasSubstr("HOST:PORT")) << bad;
  }
}

}  // namespace
}  // namespace flatshard::transport
