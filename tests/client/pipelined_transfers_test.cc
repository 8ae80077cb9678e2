// DataTransfers::GatherMany, ScatterMany and PushInits against a data server of the
// test's own that reads requests in batches: it reads one, then every other that arrives
// within 200 ms, and only then answers them all, in order. A client that waited for each
// answer before writing the next request would show batches of one. Checked: small
// groups go in pipelines of at most kMaxPipelined requests (gathers, scatters, initial
// pushes with their zeros), each answer reaches its own group (its version and bytes
// name the group), a refusal fails only its own group, a large group goes alone, a
// connection that closes mid-pipeline fails the groups whose answers were not read,
// naming the server, and a stop ends them all.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/data_transfers.h"
#include "tests/client/test_data_server.h"
#include "transport/data_protocol.h"

namespace flatshard::client_internal {
namespace {

// Group "g<k>" has (k + 1) * 4 bytes per server; a gather of it is answered with version
// k and that many bytes of value k, a scatter with version k once its payload ((k + 1) *
// 4 bytes of value k) is checked, an initial push likewise (its last 4 bytes zeros). Group "missing" is refused with NotFound. After
// `close_after` answers (0: never) the server closes the connection.
class BatchingDataServer {
 public:
  explicit BatchingDataServer(int close_after = 0) : close_after_(close_after) {}

  DataSession session() const { return server_.session(); }
  std::vector<int> batches() const {
    absl::MutexLock lock(&mu_);
    return batches_;
  }

  static int64_t IndexOf(const std::string& group) {
    int64_t index = -1;
    absl::string_view digits = group;
    return absl::ConsumePrefix(&digits, "g") && absl::SimpleAtoi(digits, &index) ? index : -1;
  }

 private:
  struct Read {
    transport::Request request;
    std::vector<std::byte> payload;
  };

  void Serve(transport::Connection& conn) {
    std::vector<Read> batch;
    int answered = 0;
    bool hello = true;
    while (true) {
      if (batch.empty() || conn.PollReadable(absl::Milliseconds(200))) {
        absl::StatusOr<transport::Request> request = transport::RecvRequest(conn);
        if (!request.ok()) return;
        const int64_t payload_bytes = request->payload_bytes;
        Read read{*std::move(request), std::vector<std::byte>(payload_bytes)};
        if (!conn.Recv(absl::MakeSpan(read.payload)).ok()) return;
        if (hello) {  // answered at once
          hello = false;
          if (!transport::SendResponse(conn, absl::OkStatus(), 0, {}).ok()) return;
          continue;
        }
        batch.push_back(std::move(read));
        continue;
      }
      {
        absl::MutexLock lock(&mu_);
        batches_.push_back(static_cast<int>(batch.size()));
      }
      for (const Read& read : batch) {
        if (close_after_ > 0 && answered == close_after_) return;  // the connection closes
        ++answered;
        if (!Answer(conn, read).ok()) return;
      }
      batch.clear();
    }
  }

  static absl::Status Answer(transport::Connection& conn, const Read& read) {
    const int64_t index = IndexOf(read.request.group);
    if (index < 0) {
      return transport::SendResponse(conn, absl::NotFoundError(absl::StrCat("no group '", read.request.group, "'")),
                                     0, {});
    }
    std::vector<std::byte> bytes((index + 1) * 4, static_cast<std::byte>(index));
    if (read.request.op == transport::DataOp::kGather) {
      return transport::SendResponse(conn, absl::OkStatus(), index, bytes);
    }
    if (read.request.op == transport::DataOp::kPushInit) std::fill(bytes.end() - 4, bytes.end(), std::byte{0});
    const absl::Status checked =
        read.payload == bytes ? absl::OkStatus() : absl::DataLossError("payload is not the group's");
    return transport::SendResponse(conn, checked, index, {});
  }

  const int close_after_;
  mutable absl::Mutex mu_;
  std::vector<int> batches_ ABSL_GUARDED_BY(mu_);  // requests read before each round of answers
  TestDataServer server_{[this](transport::Connection& conn) { Serve(conn); }};  // last: it uses the rest
};

// A client of one server over one connection, so that every pipeline waits for the one
// before it.
std::unique_ptr<DataTransfers> OneConnection(const BatchingDataServer& server) {
  const DataSession session = server.session();
  ControlCalls calls{.open_nccl_channel = nullptr,
                     .open_session = [session](int, std::stop_token) -> absl::StatusOr<DataSession> { return session; }};
  return std::make_unique<DataTransfers>(ClientOptions{.job = "j", .timeout = absl::Seconds(20), .max_in_flight = 1},
                                         std::vector<ServerEndpoint>{{.address = "server-0", .session = session, .gpu_uuid = "", .nccl = false}},
                                         std::move(calls));
}

// Groups g0..g<count-1> (their names), each with a buffer of its size filled with `fill`.
struct Groups {
  std::vector<std::vector<std::byte>> buffers;
  std::vector<DataTransfers::GroupParts> parts;
};
Groups MakeGroups(const std::vector<std::string>& names, std::byte fill, size_t large_bytes = 0) {
  Groups groups;
  groups.buffers.reserve(names.size());
  for (const std::string& name : names) {
    const int64_t index = BatchingDataServer::IndexOf(name);
    groups.buffers.emplace_back(large_bytes > 0 ? large_bytes : (index < 0 ? 4 : (index + 1) * 4), fill);
    groups.parts.push_back({name, {absl::MakeSpan(groups.buffers.back())}});
  }
  return groups;
}

std::vector<std::string> Names(int count) {
  std::vector<std::string> names;
  for (int k = 0; k < count; ++k) names.push_back(absl::StrCat("g", k));
  return names;
}

TEST(PipelinedTransfersTest, SmallGathersGoInPipelinesAndEachAnswerReachesItsGroup) {
  BatchingDataServer server;
  std::unique_ptr<DataTransfers> transfers = OneConnection(server);
  Groups groups = MakeGroups(Names(40), std::byte{0xEE});
  auto gathered = transfers->GatherMany(groups.parts, 0, DType::kFloat32, {0}, {});
  ASSERT_EQ(gathered.size(), 40u);
  for (int k = 0; k < 40; ++k) {
    absl::StatusOr<int64_t> version = gathered[k].get();
    ASSERT_TRUE(version.ok()) << k << ": " << version.status();
    EXPECT_EQ(*version, k);
    EXPECT_EQ(groups.buffers[k], std::vector<std::byte>(groups.buffers[k].size(), static_cast<std::byte>(k))) << k;
  }
  EXPECT_EQ(server.batches(), (std::vector<int>{16, 16, 8}));
}

TEST(PipelinedTransfersTest, SmallScattersGoInPipelinesAndARefusalFailsOnlyItsGroup) {
  BatchingDataServer server;
  std::unique_ptr<DataTransfers> transfers = OneConnection(server);
  std::vector<std::string> names = Names(20);
  names.insert(names.begin() + 5, "missing");
  Groups groups = MakeGroups(names, std::byte{0});
  for (size_t k = 0; k < names.size(); ++k) {
    std::fill(groups.buffers[k].begin(), groups.buffers[k].end(),
              static_cast<std::byte>(BatchingDataServer::IndexOf(names[k])));
  }
  auto scattered = transfers->ScatterMany(groups.parts, 3, DType::kFloat32, {0}, {});
  ASSERT_EQ(scattered.size(), names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    const absl::Status status = scattered[k].get();
    if (names[k] == "missing") {
      EXPECT_TRUE(absl::IsNotFound(status)) << status;
      EXPECT_NE(status.message().find("server server-0: no group 'missing'"), absl::string_view::npos) << status;
    } else {
      EXPECT_TRUE(status.ok()) << names[k] << ": " << status;
    }
  }
  EXPECT_EQ(server.batches(), (std::vector<int>{16, 5}));
}

TEST(PipelinedTransfersTest, SmallInitialPushesGoInPipelinesWithTheirZeros) {
  BatchingDataServer server;
  std::unique_ptr<DataTransfers> transfers = OneConnection(server);
  std::vector<std::vector<std::byte>> values;
  std::vector<DataTransfers::GroupInit> inits;
  for (int k = 0; k < 20; ++k) values.emplace_back(k * 4, static_cast<std::byte>(k));  // then 4 zero bytes
  for (int k = 0; k < 20; ++k) inits.push_back({absl::StrCat("g", k), {{absl::MakeConstSpan(values[k]), 4}}});
  const absl::Status pushed = transfers->PushInits(inits, {});
  EXPECT_TRUE(pushed.ok()) << pushed;
  EXPECT_EQ(server.batches(), (std::vector<int>{16, 4}));
}

TEST(PipelinedTransfersTest, AGroupLargerThanAPipelinesPartGoesAlone) {
  BatchingDataServer server;
  std::unique_ptr<DataTransfers> transfers = OneConnection(server);
  // g16383: 64 KiB, the largest part a pipeline takes; g16384 is 4 bytes more.
  Groups groups = MakeGroups({"g0", "g16384", "g1", "g16383", "g2"}, std::byte{0xEE});
  auto gathered = transfers->GatherMany(groups.parts, 0, DType::kFloat32, {0}, {});
  for (auto& future : gathered) EXPECT_TRUE(future.get().ok());
  // g0, g1, g16383 and g2 together (the large one went first: it was submitted first)
  EXPECT_EQ(server.batches(), (std::vector<int>{1, 4}));
}

TEST(PipelinedTransfersTest, AConnectionClosedMidPipelineFailsTheGroupsNotAnswered) {
  BatchingDataServer server(/*close_after=*/3);
  std::unique_ptr<DataTransfers> transfers = OneConnection(server);
  Groups groups = MakeGroups(Names(6), std::byte{0xEE});
  auto gathered = transfers->GatherMany(groups.parts, 0, DType::kFloat32, {0}, {});
  for (int k = 0; k < 6; ++k) {
    absl::StatusOr<int64_t> version = gathered[k].get();
    if (k < 3) {
      EXPECT_TRUE(version.ok()) << k << ": " << version.status();
    } else {
      EXPECT_TRUE(absl::IsUnavailable(version.status())) << k << ": " << version.status();
      EXPECT_NE(version.status().message().find("server server-0"), absl::string_view::npos) << version.status();
    }
  }
}

TEST(PipelinedTransfersTest, AStopEndsEveryGroupOfThePipeline) {
  BatchingDataServer server;
  std::unique_ptr<DataTransfers> transfers = OneConnection(server);
  Groups groups = MakeGroups(Names(4), std::byte{0xEE});
  std::stop_source stop;
  stop.request_stop();
  auto gathered = transfers->GatherMany(groups.parts, 0, DType::kFloat32, {0}, stop.get_token());
  for (auto& future : gathered) {
    const absl::StatusOr<int64_t> version = future.get();
    EXPECT_TRUE(absl::IsCancelled(version.status())) << version.status();
  }
}

}  // namespace
}  // namespace flatshard::client_internal
