// Bad input and faults against real server processes: each gets a precise status and
// the servers keep serving.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cluster_status.h"
#include "flatshard/while_waiting.h"
#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/gpu_worker.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"
#include "transport/data_protocol.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

class FaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    client_ = cluster_.Connect(0, 2);
    ASSERT_TRUE(client_.ok()) << client_.status();
    ASSERT_TRUE((*client_)->ConfigureJob({}).ok());
    auto layout = (*client_)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
  }

  // A raw data connection to server 0 (hello done unless `send_hello` is false).
  std::unique_ptr<transport::Connection> RawConnection(bool send_hello = true,
                                                      const std::string& token_override = "") {
    auto conn = cluster_.RawDataConnection(0, send_hello, token_override);
    EXPECT_TRUE(conn.ok()) << conn.status();
    return conn.ok() ? *std::move(conn) : nullptr;
  }

  // A plain gather on `conn` is served (after refused requests on it, say).
  void ExpectGatherServed(transport::Connection& conn) {
    std::vector<float> shard(layout_->shard_numel());
    transport::RequestHeader gather;
    gather.op = static_cast<uint8_t>(transport::DataOp::kGather);
    ASSERT_TRUE(transport::SendRequest(conn, gather, "test", "g", {}).ok());
    auto response = transport::RecvResponse(conn, AsBytes(shard));
    ASSERT_TRUE(response.ok());
    EXPECT_TRUE(response->status.ok()) << response->status;
  }

  absl::Status RawScatter(transport::Connection& conn, const std::string& group, int64_t step,
                          int worker, int64_t bytes) {
    std::vector<std::byte> payload(bytes);
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kScatter);
    header.version = step;
    header.worker_rank = worker;
    if (absl::Status sent = transport::SendRequest(conn, header, "test", group, payload); !sent.ok()) return sent;
    auto response = transport::RecvResponse(conn, {});
    if (!response.ok()) return response.status();
    return response->status;
  }

  // The cluster still trains: both workers complete `step`.
  void ExpectStepCompletes(int64_t step) {
    auto worker1 = cluster_.Connect(1, 2);
    ASSERT_TRUE(worker1.ok());
    ASSERT_TRUE((*worker1)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
    std::vector<float> grad(layout_->padded_numel(), 1.0f);
    auto a = (*client_)->Scatter("g", step, DType::kFloat32, AsBytes(grad));
    auto b = (*worker1)->Scatter("g", step, DType::kFloat32, AsBytes(grad));
    ASSERT_TRUE(a.get().ok());
    ASSERT_TRUE(b.get().ok());
    EXPECT_EQ(*(*client_)->WaitVersion("g", step + 1), step + 1);
  }

  // Host servers, also where FLATSHARD_TEST_MEMORY names a GPU tier: the tests below are
  // about what a server without GPU shards refuses, and about host memory.
  testing::TestCluster cluster_{
      3, "tok", ::testing::TempDir(), "", {{"--memory=host"}, {"--memory=host"}, {"--memory=host"}}};
  absl::StatusOr<std::unique_ptr<Client>> client_;
  const FlatLayout* layout_ = nullptr;
};

TEST_F(FaultsTest, WrongOrMissingTokenIsUnauthenticated) {
  ClientOptions options{.servers = cluster_.addresses(), .token = "wrong"};
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("wrong authorization token"));
  options.token = "";
  client = Client::Connect(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(FaultsTest, RegistrationIsIdempotentAndRefusesADifferentSpec) {
  EXPECT_TRUE((*client_)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  auto other = (*client_)->RegisterGroup("g", {{"w", {11}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  auto bad = (*client_)->RegisterGroup("h", {{"w", {-1}, DType::kFloat32}}, 0, SgdOptions{});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("dimension 0 is -1"));
}

// Several groups register in one call per server, their layouts in the call's order. A
// refusal (a malformed spec, a name given twice, a spec that conflicts with a registered
// group) names its group and registers none of the call's groups.
TEST_F(FaultsTest, GroupsRegisterTogetherAndARefusalNamesItsGroup) {
  // Each server's groups of job "test", which every server must hold alike.
  auto held = [&] {
    std::set<std::string> names;
    const auto statuses = FetchClusterStatus({.servers = cluster_.addresses(), .token = cluster_.token()});
    for (size_t rank = 0; rank < statuses.size(); ++rank) {
      EXPECT_TRUE(statuses[rank].ok()) << statuses[rank].status();
      std::set<std::string> here;
      for (const v1::GroupStatus& group : statuses[rank]->groups()) here.insert(group.group());
      if (rank == 0) names = here;
      EXPECT_EQ(here, names) << "server " << rank;
    }
    return names;
  };
  auto spec = [](const std::string& name, int64_t numel) {
    return GroupSpec{.group = name, .tensors = {{"w", {numel}, DType::kFloat32}}, .align = 0,
                     .optimizer = AdamOptions{}};
  };
  absl::StatusOr<std::vector<const FlatLayout*>> layouts =
      (*client_)->RegisterGroups({spec("a", 30), spec("b", 7), spec("c", 100)});
  ASSERT_TRUE(layouts.ok()) << layouts.status();
  ASSERT_EQ(layouts->size(), 3u);
  EXPECT_EQ((*layouts)[0]->unpadded_numel(), 30);
  EXPECT_EQ((*layouts)[1]->unpadded_numel(), 7);
  EXPECT_EQ((*layouts)[2]->unpadded_numel(), 100);
  std::vector<float> b(layouts->at(1)->padded_numel());
  EXPECT_TRUE((*client_)->Gather("b", 0, DType::kFloat32, AsBytes(b)).get().ok());
  EXPECT_EQ(held(), (std::set<std::string>{"a", "b", "c", "g"}));

  GroupSpec bad = spec("y", 1);
  bad.tensors[0].shape = {-1};
  const auto malformed = (*client_)->RegisterGroups({spec("x", 5), bad, spec("z", 5)});
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(malformed.status().message()), HasSubstr("group 'y': "));
  EXPECT_THAT(std::string(malformed.status().message()), HasSubstr("dimension 0 is -1"));
  const auto twice = (*client_)->RegisterGroups({spec("p", 5), spec("p", 5)});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("group 'p' is named twice"));
  EXPECT_EQ((*client_)->RegisterGroups({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(held(), (std::set<std::string>{"a", "b", "c", "g"}));

  const auto conflict = (*client_)->RegisterGroups({spec("q", 5), spec("b", 8), spec("r", 5)});
  EXPECT_EQ(conflict.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(conflict.status().message()), HasSubstr("group 'b' in job 'test'"));
  EXPECT_EQ(held(), (std::set<std::string>{"a", "b", "c", "g"}));
  // Registering again finds what is there and makes the rest.
  const auto again = (*client_)->RegisterGroups({spec("q", 5), spec("b", 7), spec("r", 5)});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->at(1), layouts->at(1));
  EXPECT_EQ(held(), (std::set<std::string>{"a", "b", "c", "g", "q", "r"}));
}

// Several groups' initial values go out at once. Values of the wrong size, or a group
// never registered, refuse the call before anything is sent, naming the group; a server's
// refusal (a group that has stepped) names its group, and the call's other groups are
// pushed as they would be alone.
TEST_F(FaultsTest, GroupsInitTogetherAndAFailureNamesItsGroup) {
  auto spec = [](const std::string& name, int64_t numel) {
    return GroupSpec{.group = name, .tensors = {{"w", {numel}, DType::kFloat32}}, .align = 0,
                     .optimizer = SgdOptions{.lr = 0.5}};
  };
  absl::StatusOr<std::vector<const FlatLayout*>> layouts =
      (*client_)->RegisterGroups({spec("a", 30), spec("b", 7), spec("c", 100)});
  ASSERT_TRUE(layouts.ok()) << layouts.status();
  auto values = [](int64_t numel, float first) {
    std::vector<float> v(numel);
    for (int64_t i = 0; i < numel; ++i) v[i] = first + static_cast<float>(i);
    return v;
  };
  // The group's values as the servers hold them, unpadded.
  auto held = [&](const std::string& group, const FlatLayout& layout) {
    std::vector<float> flat(layout.padded_numel(), -1.0f);
    EXPECT_TRUE((*client_)->Gather(group, 0, DType::kFloat32, AsBytes(flat)).get().ok()) << group;
    for (int64_t i = layout.unpadded_numel(); i < layout.padded_numel(); ++i) EXPECT_EQ(flat[i], 0.0f) << group;
    flat.resize(layout.unpadded_numel());
    return flat;
  };
  const FlatLayout& a = *layouts->at(0);
  const FlatLayout& b = *layouts->at(1);
  const FlatLayout& c = *layouts->at(2);
  std::vector<float> a_padded = values(a.padded_numel(), 1.0f);  // padded: its padding is dropped
  for (int64_t i = a.unpadded_numel(); i < a.padded_numel(); ++i) a_padded[i] = 99.0f;
  const std::vector<float> b_values = values(7, 100.0f), c_values = values(100, 200.0f);
  ASSERT_TRUE((*client_)->InitGroups({{"a", a_padded}, {"b", b_values}, {"c", c_values}}).ok());
  EXPECT_EQ(held("a", a), values(30, 1.0f));
  EXPECT_EQ(held("b", b), b_values);
  EXPECT_EQ(held("c", c), c_values);

  const std::vector<float> a_again = values(30, 1000.0f), short_b = values(6, 0.0f);
  const absl::Status wrong_size = (*client_)->InitGroups({{"a", a_again}, {"b", short_b}});
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInvalidArgument) << wrong_size;
  EXPECT_THAT(std::string(wrong_size.message()), HasSubstr("group 'b': 6 elements, expected 7"));
  const absl::Status unknown = (*client_)->InitGroups({{"a", a_again}, {"nope", short_b}});
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("'nope'"));
  EXPECT_EQ(held("a", a), values(30, 1.0f)) << "a refused call sent something";

  ExpectStepCompletes(0);  // group g is at version 1: its initial values are past
  const std::vector<float> g_values = values(10, 0.0f), c_again = values(100, 3000.0f);
  const absl::Status stepped = (*client_)->InitGroups({{"a", a_again}, {"g", g_values}, {"c", c_again}});
  EXPECT_EQ(stepped.code(), absl::StatusCode::kFailedPrecondition) << stepped;
  EXPECT_THAT(std::string(stepped.message()), HasSubstr("group 'g' is at version 1"));
  EXPECT_EQ(held("a", a), a_again);
  EXPECT_EQ(held("c", c), c_again);
}

// Specs of more than about 1 MiB go in several calls, the layouts still in order: four
// groups of 40000 tensors (about 0.7 MB of specs each) in two calls to each server.
TEST_F(FaultsTest, GroupsWithLargeSpecsRegisterInSeveralCalls) {
  auto calls = [&](size_t rank) -> int64_t {
    const auto status = FetchClusterStatus({.servers = {cluster_.addresses()[rank]}, .token = cluster_.token()})[0];
    EXPECT_TRUE(status.ok()) << status.status();
    for (const v1::NamedLatency& rpc : status->rpc_seconds()) {
      if (rpc.name() == "flatshard.v1.Flatshard/RegisterGroup") return static_cast<int64_t>(rpc.seconds().count());
    }
    return 0;
  };
  std::vector<GroupSpec> groups;
  for (int g = 0; g < 4; ++g) {
    GroupSpec& group = groups.emplace_back(GroupSpec{.group = absl::StrCat("large", g), .tensors = {}, .align = 0,
                                                     .optimizer = SgdOptions{}});
    for (int t = 0; t < 40000; ++t) {
      group.tensors.push_back({absl::StrFormat("tensor-%05d", t), {g + 1}, DType::kFloat32});
    }
  }
  const int64_t before = calls(2);
  const auto layouts = (*client_)->RegisterGroups(groups);
  ASSERT_TRUE(layouts.ok()) << layouts.status();
  EXPECT_EQ(calls(2) - before, 2);
  for (int g = 0; g < 4; ++g) EXPECT_EQ((*layouts)[g]->unpadded_numel(), 40000 * (g + 1)) << g;
}

TEST_F(FaultsTest, UnknownGroupWrongSizesAndDTypes) {
  auto conn = RawConnection();
  absl::Status unknown = RawScatter(*conn, "nope", 0, 0, 16);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("unknown group 'nope' in job 'test'"));
  absl::Status wrong_size = RawScatter(*conn, "g", 0, 0, 7);
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong_size.message()), HasSubstr("carries 7 bytes; expected 16"));
  // Same connection still works: a valid gather after refused requests.
  ExpectGatherServed(*conn);

  std::vector<float> too_small(3);
  EXPECT_EQ((*client_)->Gather("g", 0, DType::kFloat32, AsBytes(too_small)).get().status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> full(layout_->padded_numel());
  EXPECT_EQ((*client_)->Gather("g", 0, DType::kInt32, AsBytes(full)).get().status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The CUDA IPC and NCCL ops reach every server's data plane; one without GPU shards
// (any server of a CPU build) refuses them and the connection stays usable.
TEST_F(FaultsTest, GpuPlaneRequestsToAHostServerAreRefused) {
  auto conn = RawConnection();
  auto ipc = [&](transport::DataOp op, absl::Span<const std::byte> payload) {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(op);
    header.timeout_ms = 1000;
    absl::Status sent = transport::SendRequest(*conn, header, "test", "g", payload);
    if (!sent.ok()) return sent;
    auto response = transport::RecvResponse(*conn, {});
    return response.ok() ? response->status : response.status();
  };
  transport::IpcTarget target;
  target.bytes = layout_->shard_numel() * 4;
  const auto target_bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), sizeof(target));
  for (transport::DataOp op : {transport::DataOp::kIpcGather, transport::DataOp::kIpcScatter}) {
    absl::Status refused = ipc(op, target_bytes);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("does not keep its shards in GPU memory"));
  }
  absl::Status short_target = ipc(transport::DataOp::kIpcGather, target_bytes.subspan(0, 10));
  EXPECT_EQ(short_target.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_target.message()), HasSubstr("80-byte target; this one 10 bytes"));
  const transport::NcclTarget nccl_target{1, target.bytes};
  const auto nccl_bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&nccl_target), sizeof(nccl_target));
  for (transport::DataOp op : {transport::DataOp::kNcclGather, transport::DataOp::kNcclScatter}) {
    absl::Status refused = ipc(op, nccl_bytes);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("no NCCL data plane"));
  }
  EXPECT_THAT(std::string(ipc(transport::DataOp::kNcclGather, target_bytes).message()),
              HasSubstr("16-byte target; this one 80 bytes"));
  {
    auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster_.addresses()[0], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + cluster_.token());
    v1::OpenNcclChannelRequest request;
    request.set_unique_id(std::string(128, 'x'));
    v1::OpenNcclChannelResponse response;
    EXPECT_EQ(stub->OpenNcclChannel(&ctx, request, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  ExpectGatherServed(*conn);
}

// kReplicaPartial and kReplicaReduced are for the servers of a hybrid-sharded job:
// anything else is refused with its reason, on a connection that serves on, and the job
// trains on.
TEST_F(FaultsTest, MisdirectedReplicaExchangesAreRefusedAndTheServerServesOn) {
  auto conn = RawConnection();
  // A message of `bytes`, naming the load of its round unless `names_load` is false.
  auto send = [&](transport::DataOp op, int replica, DType dtype, int64_t bytes, bool names_load = true) {
    std::vector<std::byte> payload(bytes);
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(op);
    header.dtype = static_cast<uint8_t>(dtype);
    header.worker_rank = replica;
    header.timeout_ms = 1000;
    if (names_load) header.flags = transport::kRequestLoadKnown;
    absl::Status sent = transport::SendRequest(*conn, header, "test", "g", payload);
    if (!sent.ok()) return sent;
    auto response = transport::RecvResponse(*conn, {});
    return response.ok() ? response->status : response.status();
  };
  const int64_t shard_bytes = layout_->shard_numel() * 4;
  for (const auto& [op, noun] : {std::pair{transport::DataOp::kReplicaPartial, "replica partial"},
                                 std::pair{transport::DataOp::kReplicaReduced, "reduced chunk"}}) {
    const absl::Status not_hybrid = send(op, 1, DType::kFloat32, shard_bytes);
    EXPECT_EQ(not_hybrid.code(), absl::StatusCode::kInvalidArgument) << not_hybrid;
    EXPECT_THAT(std::string(not_hybrid.message()), HasSubstr("in replica group 0 of 1"));
    const absl::Status narrow = send(op, 1, DType::kBFloat16, shard_bytes / 2);
    EXPECT_THAT(std::string(narrow.message()),
                HasSubstr("the exchange between replica groups is float32, not bfloat16"));
    const absl::Status short_one = send(op, 1, DType::kFloat32, shard_bytes - 4);
    EXPECT_THAT(std::string(short_one.message()), HasSubstr(absl::StrCat(noun, " to group 'g' carries")));
    const absl::Status no_load = send(op, 1, DType::kFloat32, shard_bytes, /*names_load=*/false);
    EXPECT_EQ(no_load.code(), absl::StatusCode::kInvalidArgument) << no_load;
    EXPECT_THAT(std::string(no_load.message()),
                HasSubstr(absl::StrCat("a ", noun, " names the checkpoint load of its round")));
  }
  ExpectGatherServed(*conn);
  ExpectStepCompletes(0);
}

TEST_F(FaultsTest, BadGatherRangesAreRefusedAndTheConnectionServesOn) {
  ASSERT_TRUE((*client_)->InitGroupFromSeed("g", 7).ok());
  auto conn = RawConnection();
  const uint64_t shard_bytes = layout_->shard_numel() * 4;
  // A request on `conn`; its payload is `payload` bytes of `range` (16: all of it).
  auto request = [&](transport::DataOp op, transport::ByteRange range, DType dtype,
                     size_t payload = sizeof(transport::ByteRange)) -> absl::StatusOr<std::vector<std::byte>> {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(op);
    header.dtype = static_cast<uint8_t>(dtype);
    header.timeout_ms = 1000;
    const auto bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&range), payload);
    FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(*conn, header, "test", "g", bytes));
    std::vector<std::byte> out(op == transport::DataOp::kGather ? shard_bytes * DTypeSize(dtype) / 4 : range.bytes);
    FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(*conn, absl::MakeSpan(out)));
    FLATSHARD_RETURN_IF_ERROR(response.status);
    return out;
  };
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const uint64_t element = DTypeSize(dtype);
    auto whole = request(transport::DataOp::kGather, {}, dtype, 0);
    ASSERT_TRUE(whole.ok()) << whole.status();
    auto middle = request(transport::DataOp::kGatherRange, {element, 2 * element}, dtype);
    ASSERT_TRUE(middle.ok()) << middle.status();
    EXPECT_TRUE(std::equal(middle->begin(), middle->end(), whole->begin() + element)) << DTypeName(dtype);
  }
  const transport::ByteRange bad[] = {{0, 0}, {2, 4}, {0, 6}, {shard_bytes, 4}, {4, shard_bytes}};
  for (const transport::ByteRange& range : bad) {
    auto refused = request(transport::DataOp::kGatherRange, range, DType::kFloat32);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << range.offset << "+" << range.bytes;
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("is not a non-empty range of whole float32"));
  }
  auto short_payload = request(transport::DataOp::kGatherRange, {0, 4}, DType::kFloat32, 10);
  EXPECT_THAT(std::string(short_payload.status().message()), HasSubstr("16-byte target; this one 10 bytes"));
  ExpectGatherServed(*conn);
}

TEST_F(FaultsTest, BadScatterPartsAreRefusedAndTheConnectionServesOn) {
  auto layout = (*client_)->RegisterGroup("big", {{"w", {3000}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const uint64_t shard_bytes = (*layout)->shard_numel() * 4;  // 4000 on 3 servers
  const std::vector<transport::ByteRange> ranges = transport::SplitRanges(shard_bytes, 2);
  ASSERT_EQ(ranges.size(), 2u);
  auto conn = RawConnection();
  // Part `head` of worker 0's step-0 gradient, `bytes` after the first `head_bytes` of it.
  auto part = [&](transport::ScatterPart head, uint64_t bytes,
                  size_t head_bytes = sizeof(transport::ScatterPart)) -> absl::Status {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kScatterPart);
    header.timeout_ms = 1000;
    const std::vector<std::byte> payload(bytes);
    FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(
        *conn, header, "test", "big", absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&head), head_bytes),
        payload));
    FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(*conn, {}));
    return response.status;
  };
  const std::pair<absl::Status, std::string> refused[] = {
      {part({0, 2}, 0, 4), "a scatter part starts with its 8-byte head; this one carries 4 bytes"},
      {part({2, 2}, ranges[0].bytes), "scatter part 2 of 2 to group 'big'"},
      {part({0, 0}, ranges[0].bytes), "splits into 1 to 64 parts"},
      {part({0, 4000}, 64), "splits into 1 to 64 parts"},
      {part({0, 64}, 64), "a 4000-byte float32 slice splits into 63 parts when asked for 64"},
      {part({1, 2}, ranges[1].bytes + 4),
       absl::StrCat("carries ", ranges[1].bytes + 4, " bytes; expected ", ranges[1].bytes,
                    " (part 1 of 2 of 1000 float32 elements)")},
  };
  for (const auto& [status, message] : refused) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(message));
  }
  // The connection is in sync: both parts land and make the contribution whole.
  ASSERT_TRUE(part({1, 2}, ranges[1].bytes).ok());
  ASSERT_TRUE(part({0, 2}, ranges[0].bytes).ok());
  const absl::Status whole_again = RawScatter(*conn, "big", 0, 0, static_cast<int64_t>(shard_bytes));
  EXPECT_EQ(whole_again.code(), absl::StatusCode::kAlreadyExists) << whole_again;
  EXPECT_THAT(std::string(whole_again.message()), HasSubstr("duplicate contribution"));
  ExpectGatherServed(*conn);
}

// kSetHyperparams on the data plane: refusals name what is wrong and leave the
// connection in sync (a payload past the limit is drained); settings it takes apply on
// that server from the next step on.
TEST_F(FaultsTest, BadSettingsRequestsAreRefusedAndTheConnectionServesOn) {
  ASSERT_TRUE((*client_)->InitGroupFromSeed("g", 7).ok());
  std::vector<float> before(layout_->padded_numel());
  ASSERT_TRUE((*client_)->Gather("g", 0, DType::kFloat32, AsBytes(before)).get().ok());
  // The job's second worker registers before the settings change (a registration must
  // match the group's settings).
  auto worker1 = cluster_.Connect(1, 2);
  ASSERT_TRUE(worker1.ok()) << worker1.status();
  ASSERT_TRUE((*worker1)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  auto conn = RawConnection();
  auto send = [&](const std::string& payload, const std::string& group = "") -> absl::Status {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kSetHyperparams);
    FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(
        *conn, header, "test", group,
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(payload.data()), payload.size())));
    FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(*conn, {}));
    return response.status;
  };
  auto settings = [](const std::string& group, double lr) {
    v1::SetHyperparamsRequest request;
    v1::GroupOptimizer* entry = request.add_groups();
    entry->set_group(group);
    entry->mutable_optimizer()->mutable_sgd()->set_lr(lr);
    return request.SerializeAsString();
  };
  const std::pair<absl::Status, std::string> refused[] = {
      {send(settings("g", 0.1), "g"), "names its groups in its payload, not its header"},
      {send("\xff"), "payload is not a serialized SetHyperparamsRequest"},
      {send(""), "names no group"},
      {send(settings("g", -1)), "group 'g': "},
      {send(std::string(transport::kMaxSettingsBytes + 1, '\0')),
       absl::StrCat("carries at most ", transport::kMaxSettingsBytes, " bytes of settings; this one ",
                    transport::kMaxSettingsBytes + 1)},
  };
  for (const auto& [status, message] : refused) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(message));
  }
  const absl::Status unknown = send(settings("nope", 0.1));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("'nope'"));
  ASSERT_TRUE(send(settings("g", 0.25)).ok());
  ExpectGatherServed(*conn);
  // Server 0 steps its shard with the new rate, the others with the registered one (a
  // mean gradient of 1 everywhere).
  const std::vector<float> grad(before.size(), 1.0f);
  for (Client* worker : {client_->get(), worker1->get()}) {
    ASSERT_TRUE(worker->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  }
  std::vector<float> after(before.size());
  ASSERT_TRUE((*client_)->Gather("g", 1, DType::kFloat32, AsBytes(after)).get().ok());
  for (int64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(after[i], before[i] - (i < layout_->shard_numel() ? 0.25f : 0.5f)) << "element " << i;
  }
}

TEST_F(FaultsTest, DuplicateStaleAndFutureScattersNameTheExpectedStep) {
  auto conn = RawConnection();
  const int64_t bytes = layout_->shard_numel() * 4;
  ASSERT_TRUE(RawScatter(*conn, "g", 0, 0, bytes).ok());
  absl::Status duplicate = RawScatter(*conn, "g", 0, 0, bytes);
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(duplicate.message()), HasSubstr("duplicate contribution"));
  absl::Status future = RawScatter(*conn, "g", 3, 1, bytes);
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(future.message()), HasSubstr("expected step 0"));
  absl::Status bad_worker = RawScatter(*conn, "g", 0, 5, bytes);
  EXPECT_EQ(bad_worker.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(RawScatter(*conn, "g", 0, 1, bytes).ok());  // step 0 completes on server 0
  absl::Status stale = RawScatter(*conn, "g", 0, 1, bytes);
  EXPECT_EQ(stale.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(stale.message()), HasSubstr("already applied; expected step 1"));
}

TEST_F(FaultsTest, GarbageFramesAndBadTokensAreClosedAndServersKeepServing) {
  {
    auto conn = RawConnection();
    const std::string garbage = "GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012345678901234567890123";
    ASSERT_TRUE(conn->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(garbage.data()),
                                                sizeof(transport::RequestHeader))})
                    .ok());
    auto response = transport::RecvResponse(*conn, {});
    ASSERT_TRUE(response.ok());
    EXPECT_EQ(response->status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(response->status.message()), HasSubstr("bad frame"));
    std::byte byte;
    EXPECT_FALSE(conn->Recv(absl::MakeSpan(&byte, 1)).ok());  // closed by the server
  }
  {
    auto conn = RawConnection(/*send_hello=*/true, /*token_override=*/"not-a-session-token");
    std::byte byte;
    EXPECT_FALSE(conn->Recv(absl::MakeSpan(&byte, 1)).ok());
  }
  {
    // Truncated frame: half a header, then the peer goes away.
    auto conn = RawConnection();
    std::vector<std::byte> half(20, std::byte{0x46});
    ASSERT_TRUE(conn->Send({half}).ok());
  }
  ExpectStepCompletes(0);
}

TEST_F(FaultsTest, WorkerKilledMidScatterIsReplacedAndNothingPartialApplies) {
  {
    auto conn = RawConnection();
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kScatter);
    header.payload_bytes = layout_->shard_numel() * 4;
    header.worker_rank = 1;
    header.job_bytes = 4;
    header.group_bytes = 1;
    std::vector<std::byte> half(8, std::byte{0x7F});  // 8 of 16 payload bytes, then gone
    ASSERT_TRUE(conn->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&header), sizeof(header)),
                            absl::MakeConstSpan(reinterpret_cast<const std::byte*>("testg"), 5), half}).ok());
  }
  // The replacement contribution from worker 1 is accepted; the step applies once with
  // the full gradients (SGD lr 0.5, mean of ones: every element moves by exactly -0.5).
  ExpectStepCompletes(0);
  std::vector<float> params(layout_->padded_numel());
  ASSERT_TRUE((*client_)->Gather("g", 1, DType::kFloat32, AsBytes(params)).get().ok());
  for (int64_t i = 0; i < layout_->unpadded_numel(); ++i) EXPECT_EQ(params[i], -0.5f) << i;
}

TEST_F(FaultsTest, WorkerKilledMidGatherLeavesTheServerServing) {
  auto big = (*client_)->RegisterGroup("big", {{"w", {int64_t{8} << 20}, DType::kFloat32}}, 0,
                                       SgdOptions{.lr = 0.5});
  ASSERT_TRUE(big.ok());
  {
    auto conn = RawConnection();
    transport::RequestHeader gather;
    gather.op = static_cast<uint8_t>(transport::DataOp::kGather);
    ASSERT_TRUE(transport::SendRequest(*conn, gather, "test", "big", {}).ok());
    std::vector<std::byte> first(4096);
    ASSERT_TRUE(conn->Recv(absl::MakeSpan(first)).ok());  // the transfer has started
  }  // the worker dies with ~10 MiB still to come
  std::vector<float> full((*big)->padded_numel());
  auto version = (*client_)->Gather("big", 0, DType::kFloat32, AsBytes(full)).get();
  EXPECT_TRUE(version.ok()) << version.status();
  ExpectStepCompletes(0);
}

TEST_F(FaultsTest, SilentClientIsDisconnected) {
  auto conn = RawConnection(/*send_hello=*/false);
  std::byte byte;
  const absl::Time start = absl::Now();
  EXPECT_FALSE(conn->Recv(absl::MakeSpan(&byte, 1)).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(9));  // closed by the server's hello timeout
  ExpectStepCompletes(0);
}

// Connections that never say hello hold a thread each until the hello timeout: past
// --max_data_hellos of them, each new connection closes the one that has waited longest,
// so a flood of them neither exhausts the server's threads nor keeps clients out (their
// hello follows their connect at once). The log says so.
TEST(DataPlaneFloodTest, SilentConnectionsPastMaxDataHellosCloseTheLongestWaitingAndClientsGetThrough) {
  EXPECT_TRUE(testing::RefusesToStart({"--max_data_hellos=0"}));
  const testing::ScratchDir scratch("data-plane-flood");
  const std::string log = scratch.path() + "/server.log";
  testing::TestCluster cluster(1, "flood-token", ::testing::TempDir(), "",
                               {{"--max_data_hellos=3", "--log_file=" + log}});
  {
    auto setup = cluster.Connect(0, 1);
    ASSERT_TRUE(setup.ok()) << setup.status();
    ASSERT_TRUE((*setup)->ConfigureJob({}).ok());
    ASSERT_TRUE((*setup)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{}).ok());
    ASSERT_TRUE((*setup)->InitGroupFromSeed("g", 1).ok());
  }
  std::vector<std::unique_ptr<transport::Connection>> silent;
  for (int i = 0; i < 3; ++i) {
    auto conn = cluster.RawDataConnection(0, /*hello=*/false);
    ASSERT_TRUE(conn.ok()) << conn.status();
    silent.push_back(*std::move(conn));
    absl::SleepFor(absl::Milliseconds(50));  // accepted in this order
  }
  absl::SleepFor(absl::Milliseconds(200));
  for (const auto& conn : silent) EXPECT_FALSE(conn->PeerClosed()) << "within the limit, all wait";
  auto fourth = cluster.RawDataConnection(0, /*hello=*/false);
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  std::byte byte;
  const absl::Time start = absl::Now();
  EXPECT_FALSE(silent[0]->Recv(absl::MakeSpan(&byte, 1)).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "closed by the fourth, not by the 5 s hello timeout";
  EXPECT_FALSE(silent[1]->PeerClosed());
  EXPECT_FALSE(silent[2]->PeerClosed());

  // A client connecting now, three silent connections still waiting, gets through.
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{}).ok());  // its layout
  std::vector<float> params(10);
  const absl::StatusOr<int64_t> version = (*client)->Gather("g", 0, DType::kFloat32, AsBytes(params)).get();
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 0);
  EXPECT_TRUE(silent[1]->PeerClosed()) << "the client's connection closed the longest waiting";

  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("warning: data plane: RESOURCE_EXHAUSTED: 3 connections were waiting for their hello "
                              "(--max_data_hellos): the longest waiting closed\n"));
}

// Inside a request, each read and write may wait --data_io_timeout; between requests a
// connection may stay silent for --data_idle_timeout, after which the server closes it and
// a client opens a new one when it next gathers.
TEST(DataTimeoutsTest, AStalledRequestClosesAtTheIoTimeoutAndASilentConnectionAtTheIdleOne) {
  EXPECT_TRUE(testing::RefusesToStart({"--data_io_timeout=0s"}));
  EXPECT_TRUE(testing::RefusesToStart({"--data_idle_timeout=-1s"}));
  testing::TestCluster cluster(1, "timeouts-token", ::testing::TempDir(), "",
                               {{"--data_io_timeout=300ms", "--data_idle_timeout=3s"}});
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{}).ok());
  ASSERT_TRUE((*client)->InitGroupFromSeed("g", 1).ok());
  std::vector<float> params(10);
  auto raw_gather = [&](transport::Connection& conn) -> absl::Status {
    transport::RequestHeader gather;
    gather.op = static_cast<uint8_t>(transport::DataOp::kGather);
    FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(conn, gather, "test", "g", {}));
    FLATSHARD_ASSIGN_OR_RETURN(transport::Response response, transport::RecvResponse(conn, AsBytes(params)));
    return response.status;
  };
  auto closed_after = [](transport::Connection& conn) {  // how long until the server closes `conn`
    const absl::Time start = absl::Now();
    std::byte byte;
    const absl::Status read = conn.Recv(absl::MakeSpan(&byte, 1));
    EXPECT_TRUE(absl::IsUnavailable(read)) << read << ": the server closes it, no byte comes";
    return absl::Now() - start;
  };

  // Silent for longer than the io timeout between two requests: still served.
  auto idle = cluster.RawDataConnection(0);
  ASSERT_TRUE(idle.ok()) << idle.status();
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE(raw_gather(**idle).ok());
  const absl::Time last_request = absl::Now();

  // A request that stops after part of its header: closed at the io timeout, well before
  // the idle one.
  auto stalled = cluster.RawDataConnection(0);
  ASSERT_TRUE(stalled.ok()) << stalled.status();
  transport::RequestHeader header;
  header.op = static_cast<uint8_t>(transport::DataOp::kGather);
  ASSERT_TRUE((*stalled)->Send({absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&header), 10)}).ok());
  EXPECT_LT(closed_after(**stalled), absl::Seconds(2));

  // Silent past the idle timeout: closed then, not before.
  closed_after(**idle);
  EXPECT_GE(absl::Now() - last_request, absl::Milliseconds(2900));
  EXPECT_LT(absl::Now() - last_request, absl::Seconds(8));

  // The client's connections were closed alike; its next gather opens a new one.
  ASSERT_TRUE((*client)->Gather("g", 0, DType::kFloat32, AsBytes(params)).get().ok());
  absl::SleepFor(absl::Seconds(4));
  const absl::StatusOr<int64_t> version = (*client)->Gather("g", 0, DType::kFloat32, AsBytes(params)).get();
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 0);
}

// A server reads and drops the payload of a request it refuses up to 256 MiB; a larger
// one it answers at once and then closes, which resets the worker's send. The worker
// reads that answer: it gets the server's error, not the reset, and trains on.
TEST(RefusedBigPayloadTest, TheWorkerGetsTheServersErrorNotTheResetOfItsSend) {
  testing::TestCluster cluster(1, "big-payload-token", ::testing::TempDir());
  // One scatter request of the whole 288 MiB shard.
  auto client = cluster.Connect(
      {.num_workers = 1, .job = "big", .timeout = absl::Seconds(60), .scatter_split_bytes = 0});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  constexpr int64_t kNumel = int64_t{72} << 20;
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {kNumel}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  const std::vector<float> grad(kNumel, 1.0f);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const absl::Status future = (*client)->Scatter("g", 3, DType::kFloat32, AsBytes(grad)).get();
    EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition) << future;
    EXPECT_THAT(std::string(future.message()), HasSubstr("expected step 0")) << future;
  }
  ASSERT_TRUE((*client)->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  EXPECT_EQ(*(*client)->WaitVersion("g", 1), 1);
  std::vector<float> params(kNumel, -1.0f);
  ASSERT_TRUE((*client)->Gather("g", 1, DType::kFloat32, AsBytes(params)).get().ok());
  EXPECT_EQ(params.front(), -0.5f);
  EXPECT_EQ(params.back(), -0.5f);
}

TEST_F(FaultsTest, GatherOfAFutureVersionTimesOut) {
  ClientOptions options{.servers = cluster_.addresses(), .token = cluster_.token(),
                        .job = "test", .timeout = absl::Milliseconds(300)};
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  std::vector<float> full(layout_->padded_numel());
  auto version = (*client)->Gather("g", 5, DType::kFloat32, AsBytes(full)).get();
  EXPECT_EQ(version.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(version.status().message()), HasSubstr("timed out waiting for version 5"));
}

// The servers stop waiting shortly before the call's deadline, so the client gets their
// reason, not a bare "Deadline Exceeded".
TEST_F(FaultsTest, WaitingForAFutureVersionTimesOutSayingWhy) {
  ClientOptions options{
      .servers = cluster_.addresses(), .token = cluster_.token(), .job = "test", .timeout = absl::Milliseconds(300)};
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  auto version = (*client)->WaitVersion("g", 5);
  EXPECT_EQ(version.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(version.status().message()), HasSubstr("timed out waiting for version 5"));
}

// Linux overcommits, so without the server's own check the registration would succeed
// and zeroing the shards would bring the OOM killer (server/host_memory.h).
TEST_F(FaultsTest, AGroupLargerThanTheServersMemoryIsResourceExhausted) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t total_kib = 0;
  while (meminfo >> key && key != "MemTotal:") meminfo.ignore(1 << 10, '\n');
  ASSERT_TRUE(meminfo >> total_kib) << "no MemTotal in /proc/meminfo";
  // Per server: a float32 shard of four times the machine's memory. malloc would refuse
  // that too, with another message: the test fails, rather than the machine, if the
  // check is broken.
  const int64_t numel = total_kib * 1024 * static_cast<int64_t>(cluster_.addresses().size());
  auto layout = (*client_)->RegisterGroup("huge", {{"w", {numel}, DType::kFloat32}}, 0,
                                          AdamOptions{});
  EXPECT_TRUE(absl::IsResourceExhausted(layout.status())) << layout.status();
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr("group 'huge' parameters"));
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr("bytes of host memory asked"));
  ExpectStepCompletes(0);
}

TEST_F(FaultsTest, ConnectRefusesOptionsOutOfRangeBeforeCallingAnyServer) {
  const ClientOptions good{.servers = cluster_.addresses(), .token = cluster_.token(), .job = "test"};
  const std::pair<std::function<void(ClientOptions&)>, const char*> cases[] = {
      {[](ClientOptions& o) { o.servers.clear(); }, "servers: empty"},
      {[](ClientOptions& o) { o.worker_rank = 1; }, "worker_rank 1 outside [0, num_workers=1)"},
      {[](ClientOptions& o) { o.max_in_flight = 0; }, "max_in_flight 0 outside [1, 64]"},
      {[](ClientOptions& o) { o.max_in_flight = 65; }, "max_in_flight 65 outside [1, 64]"},
      {[](ClientOptions& o) { o.timeout = absl::ZeroDuration(); }, "timeout 0 is not positive"},
      {[](ClientOptions& o) { o.gather_split_bytes = -1; }, "gather_split_bytes -1 is negative"},
      {[](ClientOptions& o) { o.scatter_split_bytes = -2; }, "scatter_split_bytes -2 is negative"},
      {[](ClientOptions& o) { o.tls_reload_interval = -absl::Seconds(1); }, "tls_reload_interval -1s is negative"},
  };
  for (const auto& [corrupt, message] : cases) {
    ClientOptions options = good;
    corrupt(options);
    auto client = Client::Connect(options);
    EXPECT_TRUE(absl::IsInvalidArgument(client.status())) << message << ": " << client.status();
    EXPECT_THAT(std::string(client.status().message()), HasSubstr(message));
  }
  EXPECT_TRUE(Client::Connect(good).ok());
}

// Workers 0 .. n-1 of an n-worker `job`, each with group "g" (`numel` float32 elements,
// SGD lr 0.5) registered.
template <size_t n>
void ConnectHybridWorkers(const testing::TestCluster& cluster, const JobOptions& job,
                          std::unique_ptr<Client> (&workers)[n], const FlatLayout*& layout,
                          int64_t numel = 10) {
  for (int w = 0; w < static_cast<int>(n); ++w) {
    auto client = cluster.Connect(w, static_cast<int>(n));
    ASSERT_TRUE(client.ok()) << client.status();
    workers[w] = *std::move(client);
    ASSERT_TRUE(workers[w]->ConfigureJob(job).ok());
    auto registered = workers[w]->RegisterGroup("g", {{"w", {numel}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
    ASSERT_TRUE(registered.ok()) << registered.status();
    layout = *registered;
  }
}

// Hybrid sharding: a peer replica group that cannot be reached at the exchange fails the
// contribution with UNAVAILABLE naming it; once it is back, sending the contribution
// again (as a worker does after an error) completes the step in both replica groups.
TEST(HybridFaultsTest, AnUnreachablePeerFailsTheScatterAndAResendCompletesTheStep) {
  const std::vector<std::string> quick_peers = {"--peer_timeout=1s"};
  testing::TestCluster cluster(4, "tok", ::testing::TempDir(), "", {quick_peers, quick_peers, quick_peers, quick_peers});
  std::unique_ptr<Client> workers[2];
  const FlatLayout* layout = nullptr;
  ConnectHybridWorkers(cluster, {.replicas = 2}, workers, layout);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<float> grad0(layout->padded_numel(), 1.0f), grad1(layout->padded_numel(), 3.0f);

  ASSERT_TRUE(cluster.Pause(2));  // replica group 1's server of shard 0
  const absl::Status failed = workers[0]->Scatter("g", 0, DType::kFloat32, AsBytes(grad0)).get();
  cluster.Resume(2);
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_THAT(std::string(failed.message()), HasSubstr("could not reach server 2"));
  const absl::Status again = workers[0]->Scatter("g", 0, DType::kFloat32, AsBytes(grad0)).get();
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;  // arrived: the step goes on
  ASSERT_TRUE(workers[1]->Scatter("g", 0, DType::kFloat32, AsBytes(grad1)).get().ok());
  for (int w = 0; w < 2; ++w) {
    std::vector<float> params(layout->padded_numel(), 7.0f);
    auto version = workers[w]->Gather("g", 1, DType::kFloat32, AsBytes(params)).get();
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(*version, 1);
    params.resize(layout->unpadded_numel());
    EXPECT_EQ(params, std::vector<float>(params.size(), -1.0f)) << "worker " << w;  // -0.5 * (1 + 3) / 2
  }
}

// Three replica groups of one server each (server q reduces chunk q of the shard). A
// peer that stops after taking its own workers' contributions holds up two sends: the
// broadcast that server 0 runs aside once server 2's partial completes its chunk (no
// worker waits on it: it is delivered when the peer resumes), and server 2's partial
// (its worker gets UNAVAILABLE and sends again). The step then completes everywhere
// without workers 0 and 1 doing anything more.
TEST(HybridFaultsTest, ABroadcastRunningAsideWaitsOutAStoppedPeer) {
  const std::vector<std::string> quick_peers = {"--peer_timeout=1s"};
  testing::TestCluster cluster(3, "tok", ::testing::TempDir(), "", {quick_peers, quick_peers, quick_peers});
  std::unique_ptr<Client> workers[3];
  const FlatLayout* layout = nullptr;
  ConnectHybridWorkers(cluster, {.replicas = 3}, workers, layout, 40);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto grad = [&](float value) { return std::vector<float>(layout->padded_numel(), value); };
  const std::vector<float> grads[3] = {grad(1.0f), grad(3.0f), grad(5.0f)};
  for (int w = 0; w < 2; ++w) {
    const absl::Status sent = workers[w]->Scatter("g", 0, DType::kFloat32, AsBytes(grads[w])).get();
    ASSERT_TRUE(sent.ok()) << sent;
  }
  ASSERT_TRUE(cluster.Pause(1));
  const absl::Status failed = workers[2]->Scatter("g", 0, DType::kFloat32, AsBytes(grads[2])).get();
  absl::SleepFor(absl::Milliseconds(500));  // server 0's broadcast to server 1 is in flight
  cluster.Resume(1);
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_THAT(std::string(failed.message()), HasSubstr("could not reach server 1"));
  const absl::Status again = workers[2]->Scatter("g", 0, DType::kFloat32, AsBytes(grads[2])).get();
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  for (int w = 0; w < 3; ++w) {
    std::vector<float> params(layout->padded_numel(), 7.0f);
    auto version = workers[w]->Gather("g", 1, DType::kFloat32, AsBytes(params)).get();
    ASSERT_TRUE(version.ok()) << version.status();
    params.resize(layout->unpadded_numel());
    EXPECT_EQ(params, std::vector<float>(params.size(), -1.5f)) << "worker " << w;  // -0.5 * 9 / 3
  }
  // What went through counts once: server q sends the other chunks of its partial and its
  // own chunk to 2 peers, n + c_q elements, so 2n x 2 = 4n over the three (n: the shard).
  int64_t sent = 0, received = 0;
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    ASSERT_TRUE(status.ok()) << status.status();
    sent += status->exchange_bytes_sent();
    received += status->exchange_bytes_received();
  }
  EXPECT_EQ(sent, 4 * layout->shard_numel() * static_cast<int64_t>(sizeof(float)));
  EXPECT_EQ(received, sent);
}

// skip_nonfinite in a hybrid-sharded job: one worker's inf skips the step in both replica
// groups (each sees the same norm from its own servers); the next step applies.
TEST(HybridFaultsTest, ANonFiniteStepIsSkippedInEveryReplicaGroup) {
  testing::TestCluster cluster(4, "tok", ::testing::TempDir());
  std::unique_ptr<Client> workers[2];
  const FlatLayout* layout = nullptr;
  ConnectHybridWorkers(cluster, {.replicas = 2, .skip_nonfinite = true}, workers, layout);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto step = [&](int64_t s, const std::vector<float>& grad0, const std::vector<float>& grad1) {
    auto a = workers[0]->Scatter("g", s, DType::kFloat32, AsBytes(grad0));
    auto b = workers[1]->Scatter("g", s, DType::kFloat32, AsBytes(grad1));
    const absl::Status first = a.get(), second = b.get();
    ASSERT_TRUE(first.ok()) << first;
    ASSERT_TRUE(second.ok()) << second;
  };
  std::vector<float> bad(layout->padded_numel(), 1.0f);
  bad[7] = std::numeric_limits<float>::infinity();
  step(0, std::vector<float>(layout->padded_numel(), 1.0f), bad);
  step(1, std::vector<float>(layout->padded_numel(), 1.0f), std::vector<float>(layout->padded_numel(), 3.0f));
  for (int w = 0; w < 2; ++w) {
    const absl::StatusOr<double> skipped = workers[w]->GradNorm(0);
    ASSERT_TRUE(skipped.ok()) << skipped.status();
    EXPECT_TRUE(std::isinf(*skipped)) << *skipped;
    std::vector<float> params(layout->padded_numel(), 7.0f);
    ASSERT_EQ(*workers[w]->Gather("g", 2, DType::kFloat32, AsBytes(params)).get(), 2);
    params.resize(layout->unpadded_numel());
    EXPECT_EQ(params, std::vector<float>(params.size(), -1.0f)) << "worker " << w;  // step 1 only
  }
  // Every server counted the skip, and shows step 1's norm as the last.
  const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()});
  for (const auto& status : statuses) {
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->jobs_size(), 1) << status->DebugString();
    EXPECT_EQ(status->jobs(0).skipped_steps(), 1) << status->rank();
    EXPECT_EQ(status->jobs(0).last_norm_step(), 1) << status->rank();
    EXPECT_EQ(status->jobs(0).replicas(), 2) << status->rank();
  }
}

// Worker 0 of `workers` with a 60 s timeout (a wait that nothing ends runs that long), in
// job "test", which clips at norm 1 (GradNorm waits for its step), and its group "g" of
// ten floats; a null client after a failure.
struct ClippedWorker {
  std::unique_ptr<Client> client;
  int64_t padded_numel = 0;
};
ClippedWorker StartClippedWorker(const testing::TestCluster& cluster, int workers) {
  ClippedWorker worker;
  auto client =
      cluster.Connect({.worker_rank = 0, .num_workers = workers, .job = "test", .timeout = absl::Seconds(60)});
  if (!client.ok()) {
    ADD_FAILURE() << client.status();
    return worker;
  }
  EXPECT_TRUE((*client)->ConfigureJob({.max_grad_norm = 1.0}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  if (!layout.ok()) {
    ADD_FAILURE() << layout.status();
    return worker;
  }
  worker.padded_numel = (*layout)->padded_numel();
  worker.client = *std::move(client);
  return worker;
}

// Polls server 0 of `cluster` for up to 10 s until it serves `data_requests` data-plane
// requests and `rpcs` control-plane calls besides the status call that asks; false if it
// never does (the status then fails the test).
bool AwaitInFlight(const testing::TestCluster& cluster, int data_requests, int rpcs) {
  const ClientOptions status_options{.servers = {cluster.addresses()[0]}, .token = cluster.token()};
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    const absl::StatusOr<v1::ServerStatus> status = FetchClusterStatus(status_options)[0];
    if (!status.ok()) {
      ADD_FAILURE() << status.status();
      return false;
    }
    if (status->data_requests_in_flight() == data_requests && status->rpcs_in_flight() == rpcs + 1) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ADD_FAILURE() << "server 0 never served " << data_requests << " data requests and " << rpcs << " rpcs at once";
  return false;
}

// A server told to stop (SIGTERM: `systemctl stop`, a pod's termination) while workers
// wait on it, for a version or a step's gradient norm, ends their waits with UNAVAILABLE
// and exits within its shutdown grace. Before, each wait held the shutdown until its
// deadline: the client's timeout, 60 s here (the test's limit is 30 s).
TEST(ServerShutdownTest, WaitsEndWhenTheServerStopsAndItExitsAtOnce) {
  testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  ClippedWorker worker = StartClippedWorker(cluster, 2);
  ASSERT_NE(worker.client, nullptr);
  // Worker 1 never sends: version 1 and the norm of step 0 never come.
  std::vector<float> params(worker.padded_numel);
  auto gathered = worker.client->Gather("g", 1, DType::kFloat32, AsBytes(params));
  auto version = std::async(std::launch::async, [&] { return worker.client->WaitVersion("g", 1); });
  auto norm = std::async(std::launch::async, [&] { return worker.client->GradNorm(0); });
  ASSERT_TRUE(AwaitInFlight(cluster, 1, 2));  // the three wait on the server
  const auto [status, took] = cluster.Terminate(0, absl::Seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_LT(took, absl::Seconds(20));
  const absl::StatusOr<int64_t> gather = gathered.get();
  EXPECT_TRUE(absl::IsUnavailable(gather.status())) << gather.status();
  EXPECT_THAT(std::string(gather.status().message()), HasSubstr("server 0 is shutting down"));
  const absl::StatusOr<int64_t> waited = version.get();
  EXPECT_TRUE(absl::IsUnavailable(waited.status())) << waited.status();
  EXPECT_THAT(std::string(waited.status().message()), HasSubstr("server 0 is shutting down"));
  const absl::StatusOr<double> norm_of_step = norm.get();
  EXPECT_TRUE(absl::IsUnavailable(norm_of_step.status())) << norm_of_step.status();
  EXPECT_THAT(std::string(norm_of_step.status().message()), HasSubstr("server 0 is shutting down"));
}

// Connections with no call in progress (a worker between steps, a peer server) do not
// hold a shutdown up. gRPC's own graceful shutdown would wait for them to close, up to
// the whole grace (60 s here): an idle gRPC client notices only every few seconds (its
// backup poller), and one that does not read its socket (the HTTP/2 connection opened
// by hand here) never does.
TEST(ServerShutdownTest, ConnectionsWithNoCallInProgressDoNotHoldItUp) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), "", {{"--shutdown_grace=60s"}, {}});
  std::string host;
  int port = 0;
  ASSERT_TRUE(transport::SplitHostPort(cluster.addresses()[0], host, port).ok());
  auto silent = transport::ConnectTcp(host, port, absl::Seconds(10));
  ASSERT_TRUE(silent.ok()) << silent.status();
  // The client's connection preface: the magic, then an empty SETTINGS frame.
  const absl::string_view magic = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  std::vector<char> preface(magic.begin(), magic.end());
  preface.insert(preface.end(), {0, 0, 0, 4, 0, 0, 0, 0, 0});
  ASSERT_TRUE((*silent)->Send({AsBytes(preface)}).ok());
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params((*layout)->padded_numel());
  ASSERT_EQ((*client)->Gather("g", 0, DType::kFloat32, AsBytes(params)).get().value_or(-1), 0);
  const auto [status, took] = cluster.Terminate(0, absl::Seconds(90));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_LT(took, absl::Seconds(10));  // gRPC's graceful shutdown: 20 s (its GOAWAY ping's timeout)
}

// A stop asked of a wait's std::stop_token (a Ctrl-C handler's) ends it at once,
// CANCELLED, rather than at the client's timeout (60 s here); one asked before the call
// ends it before it reaches a server. The client serves on.
TEST(StoppedWaitTest, AStopEndsAWaitForAVersionOrANormAtOnce) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  ClippedWorker worker = StartClippedWorker(cluster, 1);
  ASSERT_NE(worker.client, nullptr);
  std::stop_source version_source, norm_source;
  const absl::Time start = absl::Now();
  auto version =
      std::async(std::launch::async, [&] { return worker.client->WaitVersion("g", 1, version_source.get_token()); });
  auto norm = std::async(std::launch::async, [&] { return worker.client->GradNorm(0, norm_source.get_token()); });
  ASSERT_TRUE(AwaitInFlight(cluster, 0, 2));  // both wait on the servers: no step comes
  version_source.request_stop();
  norm_source.request_stop();
  const absl::StatusOr<int64_t> waited = version.get();
  EXPECT_TRUE(absl::IsCancelled(waited.status())) << waited.status();
  EXPECT_EQ(waited.status().message(), "the wait for version 1 of group 'g' was stopped");
  const absl::StatusOr<double> norm_of_step = norm.get();
  EXPECT_TRUE(absl::IsCancelled(norm_of_step.status())) << norm_of_step.status();
  EXPECT_EQ(norm_of_step.status().message(), "the wait for the gradient norm of step 0 was stopped");
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_TRUE(absl::IsCancelled(worker.client->WaitVersion("g", 1, version_source.get_token()).status()));
  EXPECT_TRUE(absl::IsCancelled(worker.client->GradNorm(0, norm_source.get_token()).status()));
  std::vector<float> grad(worker.padded_numel, 0.0f);
  std::fill_n(grad.begin(), 10, 1.0f);  // the padding's gradient stays 0
  ASSERT_TRUE(worker.client->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  EXPECT_EQ(worker.client->WaitVersion("g", 1).value_or(-1), 1);
  const absl::StatusOr<double> reduced = worker.client->GradNorm(0);
  ASSERT_TRUE(reduced.ok()) << reduced.status();
  EXPECT_NEAR(*reduced, std::sqrt(10.0), 1e-6);  // ten gradients of 1
}

// A client of job "test" on `cluster` (worker 0 of 1, a 60 s timeout) with its job
// configured and group "g" of `numel` float32 registered (SGD); nullptr after a failure.
std::unique_ptr<Client> ConfiguredClient(const testing::TestCluster& cluster, int64_t numel = 10) {
  auto client = cluster.Connect({.worker_rank = 0, .num_workers = 1, .job = "test", .timeout = absl::Seconds(60)});
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok() || !(*client)->ConfigureJob({}).ok()) return nullptr;
  auto layout = (*client)->RegisterGroup("g", {{"w", {numel}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(client) : nullptr;
}

// Runs `call` on a thread, checks that it still waits after `stuck_for`, asks its stop
// and returns its outcome; fails the test when the stop did not end it within 10 s.
absl::Status StopWhileItWaits(const std::function<absl::Status(std::stop_token)>& call,
                              absl::Duration stuck_for = absl::Milliseconds(200)) {
  std::stop_source source;
  auto outcome = std::async(std::launch::async, [&] { return call(source.get_token()); });
  EXPECT_EQ(outcome.wait_for(absl::ToChronoMilliseconds(stuck_for)), std::future_status::timeout) << "not stuck";
  source.request_stop();
  EXPECT_EQ(outcome.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "the stop did not end it";
  return outcome.get();
}

// Every control call a client makes takes a stop token: against a server that stopped
// answering (SIGSTOP here; a hung host, a partition), a stop ends the call at once,
// rather than at the client's timeout (60 s here) or, for calls whose work grows with the
// model, keepalive's verdict. Once the server answers again the client serves on.
TEST(StoppedCallTest, AStopEndsAControlCallToAServerThatStoppedAnswering) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  const std::unique_ptr<Client> client = ConfiguredClient(cluster);
  ASSERT_NE(client, nullptr);
  Client& c = *client;
  const SgdOptions sgd{.lr = 0.5};
  const ClientOptions status_options{
      .servers = cluster.addresses(), .token = cluster.token(), .timeout = absl::Seconds(60)};
  const std::map<std::string, std::function<absl::Status(std::stop_token)>> calls = {
      {"ConfigureJob", [&](std::stop_token stop) { return c.ConfigureJob({}, stop); }},
      {"DeleteJob", [&](std::stop_token stop) { return c.DeleteJob(stop).status(); }},
      {"RegisterGroup",
       [&](std::stop_token stop) {
         return c.RegisterGroup("h", {{"w", {10}, DType::kFloat32}}, 0, sgd, stop).status();
       }},
      {"InitGroupFromSeed", [&](std::stop_token stop) { return c.InitGroupFromSeed("g", 7, stop); }},
      {"SetHyperparams", [&](std::stop_token stop) { return c.SetHyperparams("g", sgd, stop); }},
      {"ListCheckpoints", [&](std::stop_token stop) { return c.ListCheckpoints(stop).status(); }},
      {"DeleteCheckpoint", [&](std::stop_token stop) { return c.DeleteCheckpoint("none", stop); }},
      {"FetchClusterStatus",
       [&](std::stop_token stop) { return FetchClusterStatus(status_options, stop)[0].status(); }},
  };
  ASSERT_TRUE(cluster.Pause(0));  // every one of these calls asks server 0 first
  absl::Cleanup resume = [&] { cluster.Resume(0); };
  for (const auto& [name, call] : calls) {
    SCOPED_TRACE(name);
    const absl::Status status = StopWhileItWaits(call);
    EXPECT_TRUE(absl::IsCancelled(status)) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("server ", cluster.addresses()[0], ": the call was stopped")));
  }
  std::move(resume).Invoke();
  ASSERT_TRUE(c.ConfigureJob({}).ok());  // (a DeleteJob the server read before the stop may have gone through)
  ASSERT_TRUE(c.RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, sgd).ok());
  std::vector<float> params(10);
  EXPECT_EQ(c.Gather("g", 0, DType::kFloat32, AsBytes(params)).get().value_or(-1), 0);
  EXPECT_TRUE(FetchClusterStatus(status_options)[0].ok());
}

// A WhileWaiting hook runs on the calling thread every kWaitSlice while a call waits for
// a server that stopped answering, and stops it from there, with no second thread (how
// Python sees Ctrl-C): a call to server 0, the part of a registration that waits for the
// other servers at once (server 1 stopped), and an initial push.
TEST(StoppedCallTest, AWaitHookRunsOnTheCallingThreadAndStopsTheCall) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  const std::unique_ptr<Client> client = ConfiguredClient(cluster);
  ASSERT_NE(client, nullptr);
  Client& c = *client;
  const SgdOptions sgd{.lr = 0.5};
  const std::vector<float> values(10, 1.0f);
  struct Case {
    std::string name;
    int paused;
    std::function<absl::Status(std::stop_token)> call;
  };
  const std::vector<Case> cases = {
      {"ConfigureJob", 0, [&](std::stop_token stop) { return c.ConfigureJob({}, stop); }},
      {"RegisterGroup", 1,
       [&](std::stop_token stop) {
         return c.RegisterGroup("h", {{"w", {10}, DType::kFloat32}}, 0, sgd, stop).status();
       }},
      {"InitGroup", 0, [&](std::stop_token stop) { return c.InitGroup("g", values, stop); }},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    ASSERT_TRUE(cluster.Pause(test.paused));
    absl::Cleanup resume = [&] { cluster.Resume(test.paused); };
    std::stop_source source;
    int calls = 0;
    bool elsewhere = false;
    const std::thread::id caller = std::this_thread::get_id();
    absl::Status status;
    const absl::Time start = absl::Now();
    {
      const WhileWaiting hook([&] {
        elsewhere |= std::this_thread::get_id() != caller;
        if (++calls == 4) source.request_stop();
      });
      status = test.call(source.get_token());
    }
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(absl::IsCancelled(status)) << status;
    EXPECT_GE(calls, 4);
    EXPECT_FALSE(elsewhere) << "the hook ran on another thread";
    EXPECT_GE(took, 3 * kWaitSlice) << "the hook was not called every kWaitSlice";
    EXPECT_LT(took, absl::Seconds(10));
  }
  ASSERT_TRUE(c.ConfigureJob({}).ok());  // the client serves on
}

// Two servers and a client of them whose group "g" (ConfiguredClient) holds 16 MiB per
// server: more than a socket holds, so a transfer to a server that stopped reading waits.
class StoppedBigTransferTest : public ::testing::Test {
 protected:
  static constexpr int64_t kNumel = int64_t{8} << 20;
  void SetUp() override { ASSERT_NE(client_, nullptr); }

  testing::TestCluster cluster_{2, "tok", ::testing::TempDir()};
  const std::unique_ptr<Client> client_ = ConfiguredClient(cluster_, kNumel);
  std::vector<float> params_ = std::vector<float>(kNumel, -1.0f);
};

// Makes `send` again while a server refuses it as still being received (it is dropping
// the transfer a stop cut), for up to 10 s; returns the last outcome.
absl::Status SentAgain(const std::function<absl::Status()>& send) {
  absl::Status sent = send();
  for (const absl::Time until = absl::Now() + absl::Seconds(10);
       absl::IsFailedPrecondition(sent) && absl::Now() < until; sent = send()) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  return sent;
}

// A stop ends an InitGroup push to a server that stopped reading (SIGSTOP here) at once
// rather than at the client's timeout (60 s): the push's connection is shut down, and the
// server, running again, drops what it had received and keeps its values, while the
// other server took its shard. The push made again lands everywhere.
TEST_F(StoppedBigTransferTest, AStopEndsAnInitialPushAndTheServerItCutKeepsItsValues) {
  Client& c = *client_;
  ASSERT_EQ(c.Gather("g", 0, DType::kFloat32, AsBytes(params_)).get().value_or(-1), 0);  // connections open
  ASSERT_TRUE(cluster_.Pause(0));
  absl::Cleanup resume = [&] { cluster_.Resume(0); };
  const std::vector<float> ones(kNumel, 1.0f);
  const absl::Status status =
      StopWhileItWaits([&](std::stop_token stop) { return c.InitGroup("g", ones, stop); }, absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("server ", cluster_.addresses()[0], ": the push-init of group 'g' was stopped")));
  std::move(resume).Invoke();
  ASSERT_EQ(c.Gather("g", 0, DType::kFloat32, AsBytes(params_)).get().value_or(-1), 0);
  const size_t half = kNumel / 2;
  EXPECT_EQ(std::count(params_.begin(), params_.begin() + half, 0.0f), half) << "server 0 took part of the push";
  EXPECT_EQ(std::count(params_.begin() + half, params_.end(), 1.0f), half) << "server 1 did not take its shard";
  const std::vector<float> twos(kNumel, 2.0f);
  const absl::Status again = SentAgain([&] { return c.InitGroup("g", twos); });
  ASSERT_TRUE(again.ok()) << again;
  ASSERT_EQ(c.Gather("g", 0, DType::kFloat32, AsBytes(params_)).get().value_or(-1), 0);
  EXPECT_EQ(params_, twos);
}

// A stop ends a gather waiting for a version that does not come, and a scatter to a
// server that stopped reading (SIGSTOP), at once rather than at the client's timeout
// (60 s), both split over two connections per server (16 MiB parts). The server the
// scatter was cut from drops what it had received, the other took its part, and the
// scatter sent again completes the step with the values one full gradient gives.
// Transfers whose stop came first are never sent.
TEST_F(StoppedBigTransferTest, AStopEndsAGatherWaitingForAVersionAndAScatterToAStoppedServer) {
  Client& c = *client_;
  const std::vector<float> grad(kNumel, 1.0f);
  std::stop_source early;
  early.request_stop();
  const absl::StatusOr<int64_t> unsent = c.Gather("g", 0, DType::kFloat32, AsBytes(params_), early.get_token()).get();
  EXPECT_TRUE(absl::IsCancelled(unsent.status())) << unsent.status();
  EXPECT_EQ(params_[0], -1.0f);
  const absl::Status unsent_scatter = c.Scatter("g", 0, DType::kFloat32, AsBytes(grad), early.get_token()).get();
  EXPECT_TRUE(absl::IsCancelled(unsent_scatter)) << unsent_scatter;

  const absl::Status gathered = StopWhileItWaits([&](std::stop_token stop) {
    return c.Gather("g", 1, DType::kFloat32, AsBytes(params_), stop).get().status();  // no step comes
  });
  EXPECT_TRUE(absl::IsCancelled(gathered)) << gathered;
  EXPECT_THAT(std::string(gathered.message()), HasSubstr("of group 'g' was stopped"));

  ASSERT_TRUE(cluster_.Pause(0));
  absl::Cleanup resume = [&] { cluster_.Resume(0); };
  const absl::Status scattered = StopWhileItWaits(
      [&](std::stop_token stop) { return c.Scatter("g", 0, DType::kFloat32, AsBytes(grad), stop).get(); },
      absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsCancelled(scattered)) << scattered;
  EXPECT_THAT(std::string(scattered.message()), HasSubstr(absl::StrCat("server ", cluster_.addresses()[0],
                                                                       ": the scatter-part of group 'g' was stopped")));
  std::move(resume).Invoke();
  EXPECT_EQ(c.WaitVersion("g", 0).value_or(-1), 0);  // server 0 did not step
  // Server 1 took its part and applied the step: it answers AlreadyExists.
  const absl::Status again = SentAgain([&] { return c.Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get(); });
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  ASSERT_EQ(c.Gather("g", 1, DType::kFloat32, AsBytes(params_)).get().value_or(-1), 1);
  EXPECT_EQ(std::count(params_.begin(), params_.end(), -0.5f), kNumel);  // 0 - 0.5 * 1, once
}

// Polls server 0 of `cluster` for up to 10 s until it has ended (answered or dropped)
// `expected` requests of each name (an RPC's full method, a data op's name) and has no
// data connection open; returns what it saw last, and open connections as "connections".
std::map<std::string, uint64_t> AwaitEnded(const testing::TestCluster& cluster,
                                           const std::map<std::string, uint64_t>& expected) {
  const ClientOptions status_options{.servers = cluster.addresses(), .token = cluster.token()};
  std::map<std::string, uint64_t> ended;
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    const absl::StatusOr<v1::ServerStatus> status = FetchClusterStatus(status_options)[0];
    if (!status.ok()) {
      ADD_FAILURE() << status.status();
      return ended;
    }
    for (const v1::NamedLatency& rpc : status->rpc_seconds()) ended[rpc.name()] = rpc.seconds().count();
    for (const v1::NamedLatency& op : status->data_request_seconds()) ended[op.name()] = op.seconds().count();
    ended["connections"] = status->open_data_connections();
    if (std::all_of(expected.begin(), expected.end(), [&](const auto& e) { return ended[e.first] == e.second; }) &&
        ended["connections"] == 0) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ended;
}

// A server ends the waits of a caller that went away (a worker stopped with Ctrl-C, a
// client destroyed): its WaitVersion, GetGradNorm and data-plane gather end within
// moments, and the gather's connection closes, rather than at their deadlines (about the
// client's 60 s timeout), each holding a thread until then.
TEST(AbandonedWaitTest, AServerEndsTheWaitsOfACallerThatWentAway) {
  testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  ClippedWorker worker = StartClippedWorker(cluster, 1);
  ASSERT_NE(worker.client, nullptr);
  std::stop_source stop;
  auto version = std::async(std::launch::async, [&] { return worker.client->WaitVersion("g", 1, stop.get_token()); });
  auto norm = std::async(std::launch::async, [&] { return worker.client->GradNorm(0, stop.get_token()); });
  std::vector<float> params(worker.padded_numel);
  auto gathered = worker.client->Gather("g", 1, DType::kFloat32, AsBytes(params));  // no step comes
  absl::SleepFor(absl::Milliseconds(300));                                      // the three wait on the server
  stop.request_stop();
  EXPECT_TRUE(absl::IsCancelled(version.get().status()));
  EXPECT_TRUE(absl::IsCancelled(norm.get().status()));
  worker.client.reset();  // cancels the gather: its connection is shut down
  EXPECT_TRUE(absl::IsCancelled(gathered.get().status()));
  std::map<std::string, uint64_t> ended = AwaitEnded(
      cluster, {{"flatshard.v1.Flatshard/WaitVersion", 1}, {"flatshard.v1.Flatshard/GetGradNorm", 1}, {"gather", 1}});
  EXPECT_EQ(ended["flatshard.v1.Flatshard/WaitVersion"], 1u);
  EXPECT_EQ(ended["flatshard.v1.Flatshard/GetGradNorm"], 1u);
  EXPECT_EQ(ended["gather"], 1u);
  EXPECT_EQ(ended["connections"], 0u);
}

// The same for a GPU worker's gather from a --memory=device server, over CUDA IPC (one
// GPU) and NCCL (as between nodes): once the worker has stopped the gather, or gone, the
// server stops waiting for the version and writes nothing into its buffer. Before, the
// server held the request (and its connection) until the client's timeout, 60 s here.
TEST(AbandonedWaitTest, AServerEndsTheDeviceGathersOfACallerThatStoppedOrWentAway) {
  if (!testing::HaveGpu()) GTEST_SKIP() << "device gathers need a CUDA build and a CUDA device";
  const bool nccl = testing::HaveNccl();
  for (const DevicePlane plane : {DevicePlane::kCudaIpc, DevicePlane::kNccl}) {
    if (plane == DevicePlane::kNccl && !nccl) continue;  // said below
    SCOPED_TRACE(plane == DevicePlane::kNccl ? "NCCL" : "CUDA IPC");
    if (plane == DevicePlane::kNccl) testing::SetNcclHost(testing::kNcclServers);
    testing::TestCluster cluster(1, "tok", ::testing::TempDir(), "", {{"--memory=device"}});
    if (plane == DevicePlane::kNccl) testing::SetNcclHost(testing::kNcclWorkers);
    auto client = cluster.Connect(
        {.worker_rank = 0, .num_workers = 2, .job = "test", .timeout = absl::Seconds(60), .device_plane = plane});
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->ConfigureJob({}).ok());
    auto layout = (*client)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
    ASSERT_TRUE(layout.ok()) << layout.status();
    const int64_t padded_numel = (*layout)->padded_numel();  // the layout goes with the client
    // Two gathers at once first: over NCCL each opens a link (a join, which can take
    // seconds), so that the two below find theirs joined and reach the server's wait for
    // the version within their 500 ms; the stops would otherwise cut joins instead.
    std::vector<std::unique_ptr<testing::DeviceBytes>> warm;
    std::vector<std::future<absl::StatusOr<int64_t>>> warmed;
    for (int i = 0; i < 2; ++i) {
      warm.push_back(std::make_unique<testing::DeviceBytes>(padded_numel * 4));
      warmed.push_back((*client)->Gather("g", 0, DType::kFloat32, warm.back()->span()));
    }
    for (auto& future : warmed) ASSERT_EQ(future.get().value_or(-1), 0);
    testing::DeviceBytes device(padded_numel * 4);
    const absl::Status stopped = StopWhileItWaits(
        [&](std::stop_token stop) {
          return (*client)->Gather("g", 1, DType::kFloat32, device.span(), stop).get().status();
        },
        absl::Milliseconds(500));  // worker 1 never sends: the gather waits on the server until the stop
    EXPECT_TRUE(absl::IsCancelled(stopped)) << stopped;
    auto gathered = (*client)->Gather("g", 1, DType::kFloat32, device.span());
    absl::SleepFor(absl::Milliseconds(500));
    client->reset();
    EXPECT_TRUE(absl::IsCancelled(gathered.get().status()));
    const std::string op = plane == DevicePlane::kNccl ? "nccl-gather" : "ipc-gather";
    std::map<std::string, uint64_t> ended = AwaitEnded(cluster, {{op, 4}});
    EXPECT_EQ(ended[op], 4u);  // the two warm-ups, the stopped one, the one whose client went
    EXPECT_EQ(ended["connections"], 0u);
    std::vector<uint32_t> bits(padded_numel);
    device.Download(AsBytes(bits));
    EXPECT_EQ(bits[0], 0xA5A5A5A5u) << "the abandoned gather wrote into the buffer";
  }
  if (!nccl) GTEST_SKIP() << "CUDA IPC checked; NCCL does not load here (set FLATSHARD_NCCL_LIBRARY)";
}

// An NCCL gather from a --memory=device server that stopped answering (SIGSTOP: a hung
// host) ends at once on a stop, whether it was opening its link (the OpenNcclChannel
// call) or waiting for the server's answer on a link it had: the bytes would move
// between this process's NCCL and the server's, so once the worker's NCCL is aborted
// nothing else holds its buffer. Before, the first ran to the client's timeout (60 s
// here) and the second to its connection's (65 s). Once the server answers again it
// drops the request given up and the worker gathers on a fresh link.
TEST(StoppedNcclTest, AStopEndsAnNcclGatherToAServerThatStoppedAnswering) {
  if (!testing::HaveGpu()) GTEST_SKIP() << "NCCL gathers need a CUDA build and a CUDA device";
  if (!testing::HaveNccl()) GTEST_SKIP() << "NCCL does not load here (set FLATSHARD_NCCL_LIBRARY)";
  testing::SetNcclHost(testing::kNcclServers);
  testing::TestCluster cluster(1, "tok", ::testing::TempDir(), "", {{"--memory=device"}});
  testing::SetNcclHost(testing::kNcclWorkers);
  auto client = cluster.Connect({.worker_rank = 0,
                                 .num_workers = 1,
                                 .job = "test",
                                 .timeout = absl::Seconds(60),
                                 .device_plane = DevicePlane::kNccl});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> host((*layout)->padded_numel());
  ASSERT_TRUE((*client)->Gather("g", 0, DType::kFloat32, AsBytes(host)).get().ok());  // opens a data connection
  testing::DeviceBytes device((*layout)->padded_numel() * 4);
  auto gather = [&](std::stop_token stop) {
    return (*client)->Gather("g", 0, DType::kFloat32, device.span(), stop).get().status();
  };
  for (const char* phase : {"opening its link", "waiting for the ready answer"}) {
    SCOPED_TRACE(phase);
    ASSERT_TRUE(cluster.Pause(0));
    const absl::Status stopped = StopWhileItWaits(gather, absl::Milliseconds(500));
    cluster.Resume(0);
    EXPECT_TRUE(absl::IsCancelled(stopped)) << stopped;
    const absl::Time start = absl::Now();
    const absl::Status again = gather({});
    EXPECT_TRUE(again.ok()) << again;
    EXPECT_LT(absl::Now() - start, absl::Seconds(20)) << "the gather after the stop waited for a timeout";
  }
  std::vector<float> landed((*layout)->padded_numel(), -1.0f);
  device.Download(AsBytes(landed));
  EXPECT_EQ(landed, host) << "the gathers after the stops did not land";
}

// Destroying a client whose gather waits for a version that does not come (a worker
// stopped with Ctrl-C while another is stuck) cancels it at once, rather than wait for
// the server's answer until the client's timeout (60 s here); the server serves on.
TEST(ClientShutdownTest, DestroyingAClientCancelsItsTransfersInFlight) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  const ClientOptions options{.worker_rank = 0, .num_workers = 2, .job = "test", .timeout = absl::Seconds(60)};
  auto client = cluster.Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params((*layout)->padded_numel());
  auto gathered = (*client)->Gather("g", 1, DType::kFloat32, AsBytes(params));  // worker 1 never sends
  std::vector<std::future<absl::StatusOr<int64_t>>> queued;                     // behind it: max_in_flight is 2
  std::vector<std::vector<float>> more(3, std::vector<float>((*layout)->padded_numel()));
  for (auto& buffer : more) queued.push_back((*client)->Gather("g", 1, DType::kFloat32, AsBytes(buffer)));
  absl::SleepFor(absl::Milliseconds(300));  // the gathers wait on the servers
  const absl::Time start = absl::Now();
  client->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  const absl::StatusOr<int64_t> gather = gathered.get();
  EXPECT_TRUE(absl::IsCancelled(gather.status())) << gather.status();
  EXPECT_THAT(std::string(gather.status().message()),
              HasSubstr("the client was destroyed with this transfer in flight"));
  for (auto& future : queued) {
    const absl::StatusOr<int64_t> outcome = future.get();
    EXPECT_TRUE(absl::IsCancelled(outcome.status())) << outcome.status();
  }
  auto again = cluster.Connect(options);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)->RegisterGroup("g", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  const absl::StatusOr<int64_t> served = (*again)->Gather("g", 0, DType::kFloat32, AsBytes(params)).get();
  EXPECT_EQ(served.value_or(-1), 0) << served.status();
}

// A transfer whose data connection is still being opened to a server that stopped
// answering (SIGSTOP here: the kernel takes the connection, nobody answers its hello; a
// hung host) is cancelled too: destroying its client does not wait out the hello's
// timeout (65 s here).
TEST(ClientShutdownTest, DestroyingAClientDoesNotWaitForAConnectionBeingOpened) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  std::unique_ptr<Client> client = ConfiguredClient(cluster);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(cluster.Pause(0));
  absl::Cleanup resume = [&] { cluster.Resume(0); };
  std::vector<float> params(10);
  auto gathered = client->Gather("g", 0, DType::kFloat32, AsBytes(params));  // its first transfer
  EXPECT_EQ(gathered.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout) << "not stuck";
  const absl::Time start = absl::Now();
  client.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  const absl::StatusOr<int64_t> gather = gathered.get();
  EXPECT_TRUE(absl::IsCancelled(gather.status())) << gather.status();
  EXPECT_THAT(std::string(gather.status().message()),
              HasSubstr("the client was destroyed with this transfer in flight"));
}

}  // namespace
}  // namespace flatshard
