// Random requests against real server processes, on both planes. Every well-formed
// request gets an answer with a precise status (never UNKNOWN, INTERNAL or an empty
// message; on the data plane, exactly one answer on a connection that serves on), and
// afterwards the servers still answer and train a fresh job to the exact values. The
// seeds are fixed, so a failure reproduces; each failure names the request. The
// sanitizer build runs the same servers under AddressSanitizer.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/message.h>

#include "absl/strings/escaping.h"
#include "absl/synchronization/mutex.h"
#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"
#include "transport/data_protocol.h"

namespace flatshard {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// Values that sit on boundaries, or name what the servers hold: most random requests
// should get past the first check.
class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  template <typename T>
  T Pick(std::initializer_list<T> values) {
    return *(values.begin() + rng_() % values.size());
  }
  bool OneIn(int n) { return rng_() % n == 0; }
  uint64_t Below(uint64_t n) { return rng_() % n; }

  int64_t Int64() {
    return Pick<int64_t>({0, 1, 2, 3, 7, 1000, -1, int64_t{1} << 40,
                          std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()});
  }
  int32_t Int32() {
    return Pick<int32_t>({0, 1, 2, 3, -1, 65536, 65537, std::numeric_limits<int32_t>::max(),
                          std::numeric_limits<int32_t>::min()});
  }
  uint64_t UInt64() {
    return Pick<uint64_t>({0, 1, 4, 64, 4000, uint64_t{1} << 63, std::numeric_limits<uint64_t>::max()});
  }
  double Double() {
    return Pick<double>({0.0, 0.5, 1.0, 2.0, -1.0, 1e308, 1e-310, std::numeric_limits<double>::infinity(),
                         -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()});
  }
  std::string String() {
    return Pick<std::string>({"", "test", "async", "hy", "fz", "g", "big", "f", "ck", "../escape", "a/b", ".",
                              std::string(300, 'x'), std::string("nul\0byte", 8), kNotUtf8});
  }
  // Whether a string field got kNotUtf8 since the last call.
  bool TakeNotUtf8() { return std::exchange(not_utf8_, false); }
  std::string Bytes(size_t size) {
    std::string bytes(size, '\0');
    for (char& byte : bytes) byte = static_cast<char>(rng_());
    return bytes;
  }

  // Sets a random subset of `message`'s fields (repeated ones 0-3 times, nested messages
  // 3 deep) to values from the pools above; enums may get numbers they do not define.
  void Fill(Message& message, int depth = 0) {
    const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const FieldDescriptor* field = descriptor->field(i);
      if (OneIn(3)) continue;
      const int count = field->is_repeated() ? static_cast<int>(Below(4)) : 1;
      for (int k = 0; k < count; ++k) SetField(message, field, depth);
    }
  }

 private:
  void SetField(Message& message, const FieldDescriptor* field, int depth) {
    const google::protobuf::Reflection* reflection = message.GetReflection();
    const bool repeated = field->is_repeated();
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        repeated ? reflection->AddInt32(&message, field, Int32()) : reflection->SetInt32(&message, field, Int32());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        repeated ? reflection->AddInt64(&message, field, Int64()) : reflection->SetInt64(&message, field, Int64());
        break;
      case FieldDescriptor::CPPTYPE_UINT32: {
        const auto value = static_cast<uint32_t>(UInt64());
        repeated ? reflection->AddUInt32(&message, field, value) : reflection->SetUInt32(&message, field, value);
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT64:
        repeated ? reflection->AddUInt64(&message, field, UInt64()) : reflection->SetUInt64(&message, field, UInt64());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        repeated ? reflection->AddDouble(&message, field, Double()) : reflection->SetDouble(&message, field, Double());
        break;
      case FieldDescriptor::CPPTYPE_FLOAT: {
        const auto value = static_cast<float>(Double());
        repeated ? reflection->AddFloat(&message, field, value) : reflection->SetFloat(&message, field, value);
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL:
        repeated ? reflection->AddBool(&message, field, OneIn(2)) : reflection->SetBool(&message, field, OneIn(2));
        break;
      case FieldDescriptor::CPPTYPE_ENUM: {
        const google::protobuf::EnumDescriptor* type = field->enum_type();
        const int value = OneIn(5) ? Pick<int>({-1, 99})
                                   : type->value(static_cast<int>(Below(type->value_count())))->number();
        repeated ? reflection->AddEnumValue(&message, field, value)
                 : reflection->SetEnumValue(&message, field, value);
        break;
      }
      case FieldDescriptor::CPPTYPE_STRING: {
        const bool bytes = field->type() == FieldDescriptor::TYPE_BYTES;
        const std::string value = bytes && OneIn(2) ? Bytes(Below(200)) : String();
        if (!bytes && value == kNotUtf8) not_utf8_ = true;
        repeated ? reflection->AddString(&message, field, value) : reflection->SetString(&message, field, value);
        break;
      }
      case FieldDescriptor::CPPTYPE_MESSAGE:
        if (depth < 3) {
          Fill(repeated ? *reflection->AddMessage(&message, field) : *reflection->MutableMessage(&message, field),
               depth + 1);
        }
        break;
    }
  }

  static constexpr const char* kNotUtf8 = "\xff\xfe";

  std::mt19937_64 rng_;
  bool not_utf8_ = false;
};

// Calls `method` ("/flatshard.v1.Flatshard/Name") with `requests` (serialized messages) as
// its request stream, reads every response and returns the call's status.
grpc::Status CallRaw(grpc::GenericStub& stub, const std::string& method,
                     const std::vector<std::string>& requests, const std::string& token,
                     absl::Duration timeout) {
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(&ctx, method, &cq);
  // One operation at a time: start it, then wait for its completion.
  auto run = [&](auto start) {
    void* tag = nullptr;
    bool ok = false;
    start(reinterpret_cast<void*>(1));
    return cq.Next(&tag, &ok) && ok;
  };
  bool open = run([&](void* tag) { call->StartCall(tag); });
  for (const std::string& request : requests) {
    if (!open) break;
    grpc::Slice slice(request);
    const grpc::ByteBuffer buffer(&slice, 1);
    open = run([&](void* tag) { call->Write(buffer, tag); });
  }
  if (open) run([&](void* tag) { call->WritesDone(tag); });
  grpc::ByteBuffer response;
  while (run([&](void* tag) { call->Read(&response, tag); })) {
  }
  grpc::Status status;
  run([&](void* tag) { call->Finish(&status, tag); });
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// The seed: `fixed`, or FLATSHARD_FUZZ_SEED when set (to explore beyond the fixed runs).
uint64_t Seed(uint64_t fixed) {
  const char* seed = std::getenv("FLATSHARD_FUZZ_SEED");
  return seed != nullptr ? std::strtoull(seed, nullptr, 10) : fixed;
}

class RequestFuzzTest : public ::testing::Test {
 protected:
  // Three jobs over the three servers (sync; async; hybrid with clipping), their groups
  // registered with SGD, Adam or frozen.
  void SetUp() override {
    const std::vector<std::tuple<std::string, int, JobOptions>> jobs = {
        {"test", 2, {}}, {"async", 2, {.async = true}}, {"hy", 3, {.max_grad_norm = 1.0, .replicas = 3}}};
    for (const auto& [job, workers, options] : jobs) {
      auto client = cluster_.Connect(0, workers, job);
      ASSERT_TRUE(client.ok()) << client.status();
      ASSERT_TRUE((*client)->ConfigureJob(options).ok());
      for (const auto& [group, numel, optimizer] : std::vector<std::tuple<std::string, int64_t, OptimizerOptions>>{
               {"g", 10, SgdOptions{.lr = 0.5, .momentum = 0.9}}, {"big", 3000, AdamOptions{}}, {"f", 7, FrozenOptions{}}}) {
        auto layout = (*client)->RegisterGroup(group, {{"w", {numel}, DType::kFloat32}}, 0, optimizer);
        ASSERT_TRUE(layout.ok()) << layout.status();
        shard_bytes_[{job, group}] = static_cast<uint64_t>((*layout)->shard_numel()) * 4;
      }
      clients_.push_back(*std::move(client));
    }
  }

  // Answers by op and code, counted from several threads.
  class Tally {
   public:
    void Count(const std::string& what) {
      absl::MutexLock lock(&mu_);
      ++counts_[what];
    }
    void Print() {
      absl::MutexLock lock(&mu_);
      for (const auto& [what, n] : counts_) std::cerr << what << ": " << n << "\n";
    }

   private:
    absl::Mutex mu_;
    std::map<std::string, int> counts_ ABSL_GUARDED_BY(mu_);
  };
  void FuzzDataPlane(uint64_t seed, int requests, Tally& answers);

  // Every server still answers, and a fresh job of two workers takes a step of SGD to
  // the exact values.
  void ExpectServersTrain() {
    for (const std::string& address : cluster_.addresses()) {
      auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", "Bearer " + cluster_.token());
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::ServerStatus status;
      EXPECT_TRUE(stub->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok()) << address;
    }
    std::unique_ptr<Client> workers[2];
    for (int rank = 0; rank < 2; ++rank) {
      auto worker = cluster_.Connect(rank, 2, "clean");
      ASSERT_TRUE(worker.ok()) << worker.status();
      workers[rank] = *std::move(worker);
      ASSERT_TRUE(workers[rank]->ConfigureJob({}).ok());
      ASSERT_TRUE(workers[rank]->RegisterGroup("c", {{"w", {50}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
    }
    auto layout = workers[0]->RegisterGroup("c", {{"w", {50}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
    ASSERT_TRUE(layout.ok());
    std::vector<float> init((*layout)->padded_numel()), grads[2], params(init.size());
    for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i) / 8;
    ASSERT_TRUE(workers[0]->InitGroup("c", init).ok());
    for (int rank = 0; rank < 2; ++rank) {
      grads[rank].assign(init.size(), static_cast<float>(rank + 1));  // mean 1.5
      ASSERT_TRUE(workers[rank]->Scatter("c", 0, DType::kFloat32, AsBytes(grads[rank])).get().ok());
    }
    auto version = workers[1]->Gather("c", 1, DType::kFloat32, AsBytes(params)).get();
    ASSERT_TRUE(version.ok()) << version.status();
    for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(params[i], init[i] - 0.75f) << "element " << i;
  }

  const testing::ScratchDir root_{"fuzz-root"};
  testing::TestCluster cluster_{3, "tok", ::testing::TempDir(), root_.path()};
  std::vector<std::unique_ptr<Client>> clients_;
  std::map<std::pair<std::string, std::string>, uint64_t> shard_bytes_;  // fp32, by job and group
};

// Every RPC of the service (OpenNcclChannel excepted: a random ncclUniqueId names an
// address that NCCL would connect to) with random messages, one in eight of them without
// the token.
TEST_F(RequestFuzzTest, RandomControlRequestsGetPreciseStatusesAndTheServersTrainOn) {
  Fuzzer fuzz(Seed(20261123));
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("flatshard.v1.Flatshard");
  ASSERT_NE(service, nullptr);
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (const std::string& address : cluster_.addresses()) {
    stubs.push_back(std::make_unique<grpc::GenericStub>(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials())));
  }
  google::protobuf::DynamicMessageFactory factory;
  std::map<std::string, int> calls;
  for (int i = 0; i < 600; ++i) {
    const google::protobuf::MethodDescriptor* method =
        service->method(static_cast<int>(fuzz.Below(service->method_count())));
    if (method->name() == "OpenNcclChannel") continue;
    std::vector<std::string> requests;
    const int count = method->client_streaming() ? static_cast<int>(fuzz.Below(4)) : 1;
    std::string shown;
    for (int k = 0; k < count; ++k) {
      std::unique_ptr<Message> request(factory.GetPrototype(method->input_type())->New());
      fuzz.Fill(*request);
      requests.push_back(request->SerializeAsString());
      shown += request->ShortDebugString() + "; ";
    }
    // proto3 string fields are UTF-8: gRPC refuses to parse others before a handler
    // runs, with INTERNAL and no message.
    const bool not_utf8 = fuzz.TakeNotUtf8();
    const bool authorized = !fuzz.OneIn(8);
    const grpc::Status status =
        CallRaw(*stubs[fuzz.Below(stubs.size())], absl::StrCat("/", service->full_name(), "/", method->name()),
                requests, authorized ? cluster_.token() : (fuzz.OneIn(2) ? "" : "wrong"), absl::Milliseconds(300));
    const std::string context = absl::StrCat(method->name(), "(", shown, ") -> ", status.error_code(), " ",
                                             status.error_message());
    ++calls[absl::StrCat(method->name(), " ", status.error_code())];
    if (not_utf8) {
      // Refused by gRPC (INTERNAL) or, in a stream, by the handler at an earlier message.
      EXPECT_FALSE(status.ok()) << context;
      EXPECT_NE(status.error_code(), grpc::StatusCode::UNKNOWN) << context;
      continue;
    }
    if (!authorized) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << context;
      continue;
    }
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNKNOWN) << context;
    EXPECT_NE(status.error_code(), grpc::StatusCode::INTERNAL) << context;
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << context;
    if (!status.ok()) {
      EXPECT_FALSE(status.error_message().empty()) << context;
    }
  }
  for (const auto& [what, n] : calls) std::cerr << what << ": " << n << "\n";
  ExpectServersTrain();
}

// A response read without knowing its size: its header, message and payload size.
struct Answer {
  transport::ResponseHeader header;
  std::string message;
};

absl::StatusOr<Answer> ReadAnswer(transport::Connection& conn) {
  Answer answer;
  FLATSHARD_RETURN_IF_ERROR(
      conn.Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(&answer.header), sizeof(answer.header))));
  if (answer.header.magic != transport::kResponseMagic ||
      answer.header.message_bytes > transport::kMaxMessageBytes || answer.header.payload_bytes < 0 ||
      answer.header.payload_bytes > (int64_t{1} << 20)) {
    return absl::DataLossError("malformed response header");
  }
  answer.message.resize(answer.header.message_bytes);
  FLATSHARD_RETURN_IF_ERROR(
      conn.Recv(absl::MakeSpan(reinterpret_cast<std::byte*>(answer.message.data()), answer.message.size())));
  FLATSHARD_RETURN_IF_ERROR(transport::DrainPayload(conn, answer.header.payload_bytes));
  return answer;
}

// `requests` well-formed frames (valid op, dtype and lengths) with random fields from
// `seed`, over a connection of its own to each server: every op, job and group names that
// exist or not, worker ranks, steps and timeouts on their boundaries, payloads of the
// sizes the groups take, of others, and random targets, ranges, part heads and optimizer
// settings. Each gets exactly one answer; then each connection still serves a plain
// gather. Counts the answers by op and code into `answers`.
void RequestFuzzTest::FuzzDataPlane(uint64_t seed, int requests, Tally& answers) {
  Fuzzer fuzz(seed);
  std::vector<std::unique_ptr<transport::Connection>> conns;
  for (int rank = 0; rank < 3; ++rank) {
    auto conn = cluster_.RawDataConnection(rank);
    ASSERT_TRUE(conn.ok()) << conn.status();
    conns.push_back(*std::move(conn));
  }
  std::vector<uint64_t> sizes = {0, 4, 16, 32, 48, 64, 128, 1000, 20000};
  for (const auto& [group, bytes] : shard_bytes_) {
    for (uint64_t size : {bytes, bytes / 2, bytes + 4}) sizes.push_back(size);
  }
  auto size = [&] { return sizes[fuzz.Below(sizes.size())]; };
  for (int i = 0; i < requests; ++i) {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(1 + fuzz.Below(static_cast<int>(transport::kLastDataOp)));
    header.dtype = static_cast<uint8_t>(fuzz.Below(3));
    header.worker_rank = fuzz.Pick<int32_t>({0, 0, 1, 1, 2, 3, -1, 65536, std::numeric_limits<int32_t>::min()});
    header.version = fuzz.Pick<int64_t>({0, 0, 0, 1, 1, 2, 3, -1, std::numeric_limits<int64_t>::max(),
                                         std::numeric_limits<int64_t>::min()});
    header.timeout_ms = fuzz.Pick<int64_t>({0, 1, 20, -1, std::numeric_limits<int64_t>::min()});
    if (!fuzz.OneIn(4)) {  // the state the request comes from: none yet, or any load
      header.flags = transport::kRequestLoadKnown;
      header.load_id = fuzz.Pick<uint64_t>({0, 0, 1, fuzz.UInt64()});
    }
    const std::string job = fuzz.Pick<std::string>({"test", "test", "async", "hy", "hy", "nojob", ""});
    std::string group = fuzz.Pick<std::string>({"g", "g", "big", "f", "none"});
    std::string head;  // the target, range or part head that leads the payload
    switch (static_cast<transport::DataOp>(header.op)) {
      case transport::DataOp::kGatherRange: {
        const transport::ByteRange range{fuzz.Pick<uint64_t>({0, 4, 64, 2000, std::numeric_limits<uint64_t>::max()}),
                                         size()};
        head.assign(reinterpret_cast<const char*>(&range), sizeof(range));
        break;
      }
      case transport::DataOp::kScatterPart: {
        const transport::ScatterPart part{fuzz.Pick<uint32_t>({0, 0, 1, 1, 2, 63, 64, std::numeric_limits<uint32_t>::max()}),
                                          fuzz.Pick<uint32_t>({0, 1, 2, 2, 3, 64, 65, std::numeric_limits<uint32_t>::max()})};
        head.assign(reinterpret_cast<const char*>(&part), sizeof(part));
        break;
      }
      case transport::DataOp::kNcclGather:
      case transport::DataOp::kNcclScatter: {
        const transport::NcclTarget target{fuzz.UInt64(), fuzz.UInt64()};
        head.assign(reinterpret_cast<const char*>(&target), sizeof(target));
        break;
      }
      case transport::DataOp::kIpcGather:
      case transport::DataOp::kIpcScatter:
        head = fuzz.Bytes(sizeof(transport::IpcTarget));
        break;
      case transport::DataOp::kSetHyperparams: {  // settings of groups that exist or not, in range or not
        if (!fuzz.OneIn(4)) group.clear();       // the payload names the groups
        v1::SetHyperparamsRequest settings;
        for (uint64_t k = fuzz.Below(3); k > 0; --k) {
          v1::GroupOptimizer* entry = settings.add_groups();
          entry->set_group(fuzz.Pick<std::string>({"g", "big", "f", "none"}));
          const double lr = fuzz.Pick<double>({0.01, 0.5, 0, -1, std::numeric_limits<double>::quiet_NaN(), 1e300});
          if (fuzz.OneIn(2)) {
            entry->mutable_optimizer()->mutable_sgd()->set_lr(lr);
          } else if (!fuzz.OneIn(4)) {
            entry->mutable_optimizer()->mutable_adam()->set_lr(lr);
          }
        }
        head = settings.SerializeAsString();
        break;
      }
      default:
        break;
    }
    if (fuzz.OneIn(6)) head = fuzz.Bytes(fuzz.Below(100));  // a head of the wrong size
    const bool sends_bytes = header.op == static_cast<uint8_t>(transport::DataOp::kScatter) ||
                             header.op == static_cast<uint8_t>(transport::DataOp::kScatterPart) ||
                             header.op == static_cast<uint8_t>(transport::DataOp::kPushInit) ||
                             header.op == static_cast<uint8_t>(transport::DataOp::kReplicaPartial) ||
                             header.op == static_cast<uint8_t>(transport::DataOp::kReplicaReduced);
    uint64_t body_bytes = sends_bytes || fuzz.OneIn(8) ? size() : 0;
    // Half the time, what the server takes (for a part: if SplitRanges makes it).
    if (const auto it = shard_bytes_.find({job, group}); sends_bytes && it != shard_bytes_.end() && fuzz.OneIn(2)) {
      body_bytes = it->second / 4 * DTypeSize(static_cast<DType>(header.dtype));
      transport::ScatterPart part;
      if (header.op == static_cast<uint8_t>(transport::DataOp::kScatterPart) && head.size() == sizeof(part)) {
        std::memcpy(&part, head.data(), sizeof(part));
        const std::vector<transport::ByteRange> ranges =
            transport::SplitRanges(body_bytes, static_cast<int>(std::min<uint32_t>(part.count, 64)));
        if (part.index < ranges.size()) body_bytes = ranges[part.index].bytes;
      }
    }
    const std::string body = fuzz.Bytes(body_bytes);
    const std::string payload = head + body;
    const int rank = static_cast<int>(fuzz.Below(conns.size()));
    const std::string context =
        absl::StrCat("seed ", seed, " request ", i, " to server ", rank, ": op ", header.op, " dtype ", header.dtype,
                     " worker ", header.worker_rank, " version ", header.version, " timeout ", header.timeout_ms,
                     " ms, load ", header.flags != 0 ? absl::StrCat(header.load_id) : "unknown", ", job '", job,
                     "' group '", group, "', payload ", absl::BytesToHexString(head), " + ", body.size(), " bytes");
    ASSERT_TRUE(transport::SendRequest(*conns[rank], header, job, group,
                                       absl::MakeConstSpan(reinterpret_cast<const std::byte*>(payload.data()),
                                                           payload.size()))
                    .ok())
        << context;
    absl::StatusOr<Answer> answer = ReadAnswer(*conns[rank]);
    ASSERT_TRUE(answer.ok()) << context << ": " << answer.status();
    const auto code = static_cast<absl::StatusCode>(answer->header.code);
    answers.Count(absl::StrCat("op ", header.op, " ", absl::StatusCodeToString(code)));
    EXPECT_NE(code, absl::StatusCode::kUnknown) << context;
    EXPECT_NE(code, absl::StatusCode::kInternal) << context;
    if (code != absl::StatusCode::kOk) {
      EXPECT_FALSE(answer->message.empty()) << context;
      EXPECT_EQ(answer->header.payload_bytes, 0) << context;
    }
  }
  // Each connection is in step and serves a plain gather.
  for (int rank = 0; rank < 3; ++rank) {
    transport::RequestHeader gather;
    gather.op = static_cast<uint8_t>(transport::DataOp::kGather);
    gather.timeout_ms = 1000;
    ASSERT_TRUE(transport::SendRequest(*conns[rank], gather, "test", "f", {}).ok());
    absl::StatusOr<Answer> answer = ReadAnswer(*conns[rank]);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->header.code, 0) << answer->message;
    EXPECT_EQ(static_cast<uint64_t>(answer->header.payload_bytes), shard_bytes_.at({"test", "f"}));
  }
}

// Three such streams at once: requests race for the same slots, steps and exchanges.
TEST_F(RequestFuzzTest, RandomDataRequestsAreEachAnsweredOnAConnectionThatServesOn) {
  Tally answers;
  std::vector<std::thread> streams;
  for (uint64_t k = 0; k < 3; ++k) {
    streams.emplace_back([&, k] { FuzzDataPlane(Seed(1123) + k, 1500, answers); });
  }
  for (std::thread& stream : streams) stream.join();
  answers.Print();
  ExpectServersTrain();
}

}  // namespace
}  // namespace flatshard
