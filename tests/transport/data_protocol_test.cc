#include "transport/data_protocol.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::transport {
namespace {

using ::testing::HasSubstr;

// An in-memory Connection that reads back what was sent to it: Send appends, Recv
// consumes, and reading past the end is Unavailable, as a peer that closed.
class LoopbackConnection final : public Connection {
 public:
  LoopbackConnection() = default;
  explicit LoopbackConnection(std::string bytes) : bytes_(std::move(bytes)) {}

  absl::Status Send(std::initializer_list<absl::Span<const std::byte>> buffers) override {
    for (absl::Span<const std::byte> buffer : buffers) {
      bytes_.append(reinterpret_cast<const char*>(buffer.data()), buffer.size());
    }
    return absl::OkStatus();
  }
  absl::Status Recv(absl::Span<std::byte> buffer) override {
    if (bytes_.size() - read_ < buffer.size()) {
      return absl::UnavailableError(absl::StrCat("closed after ", bytes_.size() - read_, " of ",
                                                 buffer.size(), " bytes"));
    }
    std::memcpy(buffer.data(), bytes_.data() + read_, buffer.size());
    read_ += buffer.size();
    return absl::OkStatus();
  }
  absl::Status SetTimeout(absl::Duration) override { return absl::OkStatus(); }
  void Shutdown() override {}
  void CloseSend() override {}
  bool PeerClosed() override { return false; }
  bool PollReadable(absl::Duration) override { return read_ < bytes_.size(); }
  bool WaitReadable(absl::Duration) override { return read_ < bytes_.size(); }
  std::string peer() const override { return "loopback"; }

  size_t unread() const { return bytes_.size() - read_; }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
  size_t read_ = 0;
};

absl::Span<const std::byte> Bytes(absl::string_view text) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(text.data()), text.size());
}
absl::Span<std::byte> Bytes(std::string& text) {
  return absl::MakeSpan(reinterpret_cast<std::byte*>(text.data()), text.size());
}

template <typename T>
std::string Raw(const T& value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

RequestHeader GatherHeader() {
  RequestHeader header;
  header.op = static_cast<uint8_t>(DataOp::kGather);
  header.dtype = static_cast<uint8_t>(DType::kBFloat16);
  header.worker_rank = 3;
  header.version = 41;
  header.timeout_ms = 2500;
  return header;
}

// Logs name ops (server/data_server.cc): every op a name of its own.
TEST(DataProtocolTest, EveryOpHasADistinctName) {
  std::set<std::string> names;
  for (int op = 1; op <= static_cast<int>(kLastDataOp); ++op) {
    const std::string name = DataOpName(static_cast<DataOp>(op));
    EXPECT_FALSE(absl::StartsWith(name, "op ")) << op;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kLastDataOp));
  EXPECT_EQ(DataOpName(DataOp::kScatterPart), "scatter-part");
  EXPECT_EQ(DataOpName(DataOp::kSetHyperparams), "set-hyperparams");
  EXPECT_EQ(DataOpName(static_cast<DataOp>(99)), "op 99");
}

TEST(DataProtocolTest, RequestRoundTripsWithItsPayloadLeftOnTheConnection) {
  LoopbackConnection conn;
  ASSERT_TRUE(SendRequest(conn, GatherHeader(), "job-a", "mlp.0", Bytes("payload!")).ok());
  auto request = RecvRequest(conn);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->op, DataOp::kGather);
  EXPECT_EQ(request->dtype, DType::kBFloat16);
  EXPECT_EQ(request->worker_rank, 3);
  EXPECT_EQ(request->version, 41);
  EXPECT_EQ(request->timeout_ms, 2500);
  EXPECT_EQ(request->load_id, std::nullopt) << "no kRequestLoadKnown: the load is not known";
  EXPECT_EQ(request->job, "job-a");
  EXPECT_EQ(request->group, "mlp.0");
  ASSERT_EQ(request->payload_bytes, 8);
  std::string payload(8, '\0');
  ASSERT_TRUE(conn.Recv(Bytes(payload)).ok());
  EXPECT_EQ(payload, "payload!");
  EXPECT_EQ(conn.unread(), 0u);
}

TEST(DataProtocolTest, ARequestAndItsAnswerNameTheLoadOfTheirState) {
  LoopbackConnection conn;
  RequestHeader header = GatherHeader();
  header.op = static_cast<uint8_t>(DataOp::kScatter);
  header.flags = kRequestLoadKnown;
  header.load_id = 0xfeedface12345678;
  ASSERT_TRUE(SendRequest(conn, header, "j", "g", {}).ok());
  header.load_id = 0;  // a load that is known: none yet
  ASSERT_TRUE(SendRequest(conn, header, "j", "g", {}).ok());
  auto loaded = RecvRequest(conn);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->load_id, 0xfeedface12345678);
  auto never_loaded = RecvRequest(conn);
  ASSERT_TRUE(never_loaded.ok()) << never_loaded.status();
  EXPECT_EQ(never_loaded->load_id, 0u);

  ASSERT_TRUE(SendResponse(conn, absl::OkStatus(), 4, Bytes("ab"), 0xabc).ok());
  ASSERT_TRUE(SendResponse(conn, absl::AbortedError("loaded"), 5, {}, 0xdef).ok());
  std::string dest(2, '\0');
  auto answered = RecvResponse(conn, Bytes(dest));
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->version, 4);
  EXPECT_EQ(answered->load_id, 0xabcu);
  auto refused = RecvResponse(conn, {});
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_TRUE(absl::IsAborted(refused->status));
  EXPECT_EQ(refused->load_id, 0xdefu);
}

TEST(DataProtocolTest, APayloadTailFollowsThePayloadAndCountsInItsSize) {
  LoopbackConnection conn;
  ASSERT_TRUE(SendRequest(conn, GatherHeader(), "j", "g", Bytes("head"), Bytes("and tail")).ok());
  auto request = RecvRequest(conn);
  ASSERT_TRUE(request.ok()) << request.status();
  ASSERT_EQ(request->payload_bytes, 12);
  std::string payload(12, '\0');
  ASSERT_TRUE(conn.Recv(Bytes(payload)).ok());
  EXPECT_EQ(payload, "headand tail");
  EXPECT_EQ(conn.unread(), 0u);
}

// Every split, checked against its definition: consecutive non-empty ranges that cover
// [0, bytes), at most `count` (clamped to [1, kMaxSplitParts]), every boundary a multiple
// of 64 bytes, all ranges of one size but a shorter last one.
TEST(DataProtocolTest, SplitRangesTileTheBytesInAtMostCountPiecesOn64ByteBoundaries) {
  std::mt19937_64 rng(7);
  std::vector<std::pair<uint64_t, int>> cases = {
      {0, 2}, {1, 1}, {64, 4}, {130, 3}, {193, 3}, {194, 3}, {192 * 1000 + 2, 3},
      {uint64_t{64} << 20, 2}, {(uint64_t{64} << 20) + 4, 64}, {1000, 0}, {1000, -5}, {100000, 1000}};
  for (int i = 0; i < 2000; ++i) {
    cases.push_back({rng() % (uint64_t{1} << (rng() % 34)), static_cast<int>(rng() % 70)});
  }
  for (const auto& [bytes, count] : cases) {
    SCOPED_TRACE(absl::StrCat(bytes, " bytes in ", count));
    const std::vector<ByteRange> ranges = SplitRanges(bytes, count);
    const size_t most = static_cast<size_t>(std::clamp(count, 1, kMaxSplitParts));
    ASSERT_LE(ranges.size(), most);
    if (bytes == 0) {
      EXPECT_TRUE(ranges.empty());
      continue;
    }
    ASSERT_FALSE(ranges.empty());
    uint64_t next = 0;
    for (size_t k = 0; k < ranges.size(); ++k) {
      EXPECT_EQ(ranges[k].offset, next);
      EXPECT_EQ(ranges[k].offset % 64, 0u);
      EXPECT_GT(ranges[k].bytes, 0u);
      if (k + 1 < ranges.size()) {
        EXPECT_EQ(ranges[k].bytes, ranges[0].bytes);
      } else {
        EXPECT_LE(ranges[k].bytes, ranges[0].bytes);
      }
      next = ranges[k].offset + ranges[k].bytes;
    }
    EXPECT_EQ(next, bytes);
    // As many as asked once rounding shares up to 64 bytes cannot use up the bytes early.
    if (bytes >= 64 * most * most) {
      EXPECT_EQ(ranges.size(), most);
    }
  }
}

TEST(DataProtocolTest, SendRequestRefusesOverlongNamesBeforeSendingAnything) {
  LoopbackConnection conn;
  const std::string long_name(kMaxNameBytes + 1, 'x');
  EXPECT_TRUE(absl::IsInvalidArgument(SendRequest(conn, GatherHeader(), long_name, "g", {})));
  EXPECT_TRUE(absl::IsInvalidArgument(SendRequest(conn, GatherHeader(), "j", long_name, {})));
  EXPECT_EQ(conn.unread(), 0u);
  const std::string longest(kMaxNameBytes, 'y');
  ASSERT_TRUE(SendRequest(conn, GatherHeader(), longest, longest, {}).ok());
  auto request = RecvRequest(conn);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->job, longest);
}

// Each corruption of an otherwise valid header, and the words its refusal must contain.
struct BadHeader {
  const char* name;
  void (*corrupt)(RequestHeader&);
  const char* message;
};

TEST(DataProtocolTest, RecvRequestRefusesEachKindOfBadHeader) {
  const BadHeader cases[] = {
      {"magic", [](RequestHeader& h) { h.magic = 0x50545448; }, "magic"},
      {"op zero", [](RequestHeader& h) { h.op = 0; }, "unknown op 0"},
      {"op past the last", [](RequestHeader& h) { h.op = static_cast<uint8_t>(kLastDataOp) + 1; }, "unknown op 14"},
      {"dtype", [](RequestHeader& h) { h.dtype = 3; }, "dtype 3"},
      {"job name", [](RequestHeader& h) { h.job_bytes = kMaxNameBytes + 1; }, "too long"},
      {"group name", [](RequestHeader& h) { h.group_bytes = 60000; }, "too long"},
      {"payload", [](RequestHeader& h) { h.payload_bytes = -1; }, "payload of -1 bytes"},
      {"flags", [](RequestHeader& h) { h.flags = kRequestLoadKnown | 4; }, "unknown flags 0x5"},
  };
  for (const BadHeader& bad : cases) {
    RequestHeader header = GatherHeader();
    bad.corrupt(header);
    LoopbackConnection conn(Raw(header) + std::string(1 << 16, 'z'));
    const absl::Status status = RecvRequest(conn).status();
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << bad.name << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr(bad.message)) << bad.name;
  }
}

TEST(DataProtocolTest, TruncatedRequestsAreTransportErrors) {
  LoopbackConnection full;
  ASSERT_TRUE(SendRequest(full, GatherHeader(), "job", "group", {}).ok());
  for (size_t keep = 0; keep < full.bytes().size(); ++keep) {
    LoopbackConnection conn(full.bytes().substr(0, keep));
    EXPECT_TRUE(absl::IsUnavailable(RecvRequest(conn).status())) << keep << " bytes";
  }
}

TEST(DataProtocolTest, OkResponseLandsInTheDestination) {
  LoopbackConnection conn;
  ASSERT_TRUE(SendResponse(conn, absl::OkStatus(), 7, Bytes("0123456789")).ok());
  std::string dest(10, '\0');
  auto response = RecvResponse(conn, Bytes(dest));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(response->status.ok());
  EXPECT_EQ(response->version, 7);
  EXPECT_EQ(dest, "0123456789");
  EXPECT_EQ(conn.unread(), 0u);
}

TEST(DataProtocolTest, ErrorResponseCarriesCodeMessageAndVersionButNoPayload) {
  LoopbackConnection conn;
  ASSERT_TRUE(SendResponse(conn, absl::FailedPreconditionError("step 3 is stale"), 5,
                           Bytes("never sent"))
                  .ok());
  std::string dest(10, '#');
  auto response = RecvResponse(conn, Bytes(dest));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(response->status));
  EXPECT_EQ(response->status.message(), "step 3 is stale");
  EXPECT_EQ(response->version, 5);
  EXPECT_EQ(dest, std::string(10, '#'));
  EXPECT_EQ(conn.unread(), 0u);  // the payload was not sent
}

// A data server refuses a request whose payload is too large to read and drop by
// answering at once and closing; the close resets the sender's send, and the answer is
// still there to read after it. A peer that closes without answering leaves the send's
// error.
TEST(DataProtocolTest, AnAnswerSentBeforeACloseUnderASendIsReadOnceTheSendFails) {
  absl::StatusOr<std::unique_ptr<Listener>> listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  const std::vector<std::byte> payload(64 << 20);  // far more than the sockets buffer
  for (const bool answer : {true, false}) {
    std::thread server([&] {
      absl::StatusOr<std::unique_ptr<Connection>> conn = (*listener)->Accept();
      ASSERT_TRUE(conn.ok()) << conn.status();
      ASSERT_TRUE(RecvRequest(**conn).ok());
      if (answer) {
        ASSERT_TRUE(SendResponse(**conn, absl::FailedPreconditionError("step 3 is stale"), 5, {}).ok());
      }
    });  // closes with the payload unread: a reset
    absl::StatusOr<std::unique_ptr<Connection>> conn = ConnectTcp("127.0.0.1", (*listener)->port(), absl::Seconds(10));
    ASSERT_TRUE(conn.ok()) << conn.status();
    const absl::Status sent = SendRequest(**conn, GatherHeader(), "job", "g", payload);
    server.join();
    ASSERT_TRUE(absl::IsUnavailable(sent)) << sent;
    absl::StatusOr<Response> refused = AnswerToFailedSend(**conn, sent);
    if (answer) {
      ASSERT_TRUE(refused.ok()) << refused.status();
      EXPECT_TRUE(absl::IsFailedPrecondition(refused->status)) << refused->status;
      EXPECT_EQ(refused->status.message(), "step 3 is stale");
    } else {
      EXPECT_EQ(refused.status(), sent);
    }
  }
}

TEST(DataProtocolTest, OnlyARefusalAfterALostConnectionIsTakenForTheAnswerToAFailedSend) {
  LoopbackConnection refusal;
  ASSERT_TRUE(SendResponse(refusal, absl::NotFoundError("no group"), 0, {}).ok());
  const absl::Status timed_out = absl::DeadlineExceededError("send: timed out");
  EXPECT_EQ(AnswerToFailedSend(refusal, timed_out).status(), timed_out) << "a peer that stopped reading";
  EXPECT_EQ(refusal.unread(), sizeof(ResponseHeader) + 8) << "nothing read";
  const absl::Status reset = absl::UnavailableError("send: Connection reset by peer");
  absl::StatusOr<Response> answer = AnswerToFailedSend(refusal, reset);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_TRUE(absl::IsNotFound(answer->status)) << answer->status;

  LoopbackConnection ok;
  ASSERT_TRUE(SendResponse(ok, absl::OkStatus(), 0, {}).ok());
  EXPECT_EQ(AnswerToFailedSend(ok, reset).status(), reset) << "an OK answer refuses nothing";
  LoopbackConnection nothing;
  EXPECT_EQ(AnswerToFailedSend(nothing, reset).status(), reset);
}

TEST(DataProtocolTest, LongErrorMessagesAreTruncatedToTheLimit) {
  LoopbackConnection conn;
  ASSERT_TRUE(
      SendResponse(conn, absl::InternalError(std::string(3 * kMaxMessageBytes, 'm')), 0, {}).ok());
  auto response = RecvResponse(conn, {});
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status.message().size(), kMaxMessageBytes);
}

TEST(DataProtocolTest, ResponseOfTheWrongSizeIsDataLossAndNotWritten) {
  LoopbackConnection conn;
  ASSERT_TRUE(SendResponse(conn, absl::OkStatus(), 1, Bytes("twelve bytes")).ok());
  std::string dest(8, '#');
  const absl::Status status = RecvResponse(conn, Bytes(dest)).status();
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("sent 12 bytes, expected 8"));
  EXPECT_EQ(dest, std::string(8, '#'));
}

TEST(DataProtocolTest, MalformedResponseHeadersAreDataLoss) {
  const std::pair<const char*, void (*)(ResponseHeader&)> cases[] = {
      {"magic", [](ResponseHeader& h) { h.magic = kRequestMagic; }},
      {"negative code", [](ResponseHeader& h) { h.code = -1; }},
      {"unknown code", [](ResponseHeader& h) { h.code = 17; }},
      {"message length", [](ResponseHeader& h) { h.message_bytes = kMaxMessageBytes + 1; }},
  };
  for (const auto& [name, corrupt] : cases) {
    ResponseHeader header;
    corrupt(header);
    LoopbackConnection conn(Raw(header) + std::string(kMaxMessageBytes + 1, 'z'));
    const absl::Status status = RecvResponse(conn, {}).status();
    EXPECT_TRUE(absl::IsDataLoss(status)) << name << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr("loopback")) << name;
  }
}

TEST(DataProtocolTest, DrainPayloadConsumesExactlyThePayload) {
  LoopbackConnection conn;
  const std::string payload(3 << 20, 'p');  // several of the drain's chunks
  ASSERT_TRUE(conn.Send({Bytes(payload), Bytes("next")}).ok());
  ASSERT_TRUE(DrainPayload(conn, static_cast<int64_t>(payload.size())).ok());
  std::string next(4, '\0');
  ASSERT_TRUE(conn.Recv(Bytes(next)).ok());
  EXPECT_EQ(next, "next");
  EXPECT_TRUE(DrainPayload(conn, 0).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(DrainPayload(conn, -5)));
  EXPECT_TRUE(absl::IsUnavailable(DrainPayload(conn, 1)));
}

TEST(DataProtocolTest, DeadlineIsClampedBetweenNowAndOneDay) {
  // The deadline of `timeout_ms`, with the clock read just before and after.
  auto deadline = [](int64_t timeout_ms, absl::Time& before, absl::Time& after) {
    Request request;
    request.timeout_ms = timeout_ms;
    before = absl::Now();
    const absl::Time deadline = request.Deadline();
    after = absl::Now();
    return deadline;
  };
  absl::Time before, after;
  absl::Time at = deadline(-100, before, after);
  EXPECT_GE(at, before);
  EXPECT_LE(at, after);
  at = deadline(std::numeric_limits<int64_t>::max(), before, after);
  EXPECT_GE(at, before + absl::Hours(24));
  EXPECT_LE(at, after + absl::Hours(24));
  at = deadline(1500, before, after);
  EXPECT_GE(at, before + absl::Milliseconds(1500));
  EXPECT_LE(at, after + absl::Milliseconds(1500));
}

// Random corruptions of valid frames: every outcome is a value (a well-formed request, or
// InvalidArgument / DataLoss / Unavailable), never a crash, a huge allocation or a hang.
// Run under AddressSanitizer in the sanitizer build.
TEST(DataProtocolTest, CorruptedFramesNeverYieldOutOfBoundsValues) {
  std::mt19937 rng(20261122);
  LoopbackConnection request_frame, response_frame;
  ASSERT_TRUE(SendRequest(request_frame, GatherHeader(), "job", "group.0", Bytes("pp")).ok());
  ASSERT_TRUE(SendResponse(response_frame, absl::OkStatus(), 9, Bytes("0123")).ok());
  auto corrupt = [&](std::string bytes) {
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) bytes.resize(rng() % bytes.size());
    return bytes;
  };
  int accepted_requests = 0, accepted_responses = 0;
  for (int i = 0; i < 20000; ++i) {
    LoopbackConnection conn(corrupt(request_frame.bytes()) + std::string(64, 'z'));
    auto request = RecvRequest(conn);
    if (request.ok()) {
      ++accepted_requests;
      EXPECT_GE(static_cast<int>(request->op), static_cast<int>(DataOp::kHello));
      EXPECT_LE(static_cast<int>(request->op), static_cast<int>(kLastDataOp));
      EXPECT_LE(static_cast<int>(request->dtype), static_cast<int>(DType::kFloat16));
      EXPECT_LE(request->job.size(), kMaxNameBytes);
      EXPECT_LE(request->group.size(), kMaxNameBytes);
      EXPECT_GE(request->payload_bytes, 0);
    } else {
      EXPECT_TRUE(absl::IsInvalidArgument(request.status()) ||
                  absl::IsUnavailable(request.status()))
          << request.status();
    }
    LoopbackConnection response_conn(corrupt(response_frame.bytes()));
    std::string dest(4, '\0');
    auto response = RecvResponse(response_conn, Bytes(dest));
    if (response.ok()) {
      ++accepted_responses;
      EXPECT_GE(static_cast<int>(response->status.code()), 0);
      EXPECT_LE(static_cast<int>(response->status.code()),
                static_cast<int>(absl::StatusCode::kUnauthenticated));
    } else {
      EXPECT_TRUE(absl::IsDataLoss(response.status()) || absl::IsUnavailable(response.status()))
          << response.status();
    }
  }
  // Flips in fields that are not checked (names, version, payload bytes) still parse.
  EXPECT_GT(accepted_requests, 0);
  EXPECT_GT(accepted_responses, 0);
}

}  // namespace
}  // namespace flatshard::transport
