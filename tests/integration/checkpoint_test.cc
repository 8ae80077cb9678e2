// Checkpoints through the client against real server processes: save with 3 servers,
// load into a fresh cluster of 2, bitwise equal, and training continues identically.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "client/cli/checkpoint_command.h"
#include "client/cluster_status.h"
#include "core/safetensors.h"
#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/health_check.h"
#include "tests/integration/test_cluster.h"
#include "tests/integration/trainer.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using testing::kAdam;
using testing::kTensors;
using testing::Trainer;

// An empty directory of its own for a test (emptied if a crashed run left it).
TEST(CheckpointIntegrationTest, SaveWithThreeServersLoadIntoTwo) {
  const testing::ScratchDir root_dir("ckpt-integration");
  const std::string& root = root_dir.path();
  testing::TestCluster three(3, "tok", ::testing::TempDir(), root);
  Trainer a(three);
  ASSERT_TRUE(a.client->InitGroupFromSeed("big", 3).ok());
  ASSERT_TRUE(a.client->InitGroupFromSeed("tiny", 3).ok());
  for (int step = 0; step < 3; ++step) a.Step(step);
  ASSERT_TRUE(a.client->SaveCheckpoint("sharded-3", CheckpointKind::kSharded, true).ok());
  ASSERT_TRUE(a.client->SaveCheckpoint("full-3", CheckpointKind::kFull, true).ok());
  EXPECT_EQ(a.client->SaveCheckpoint("full-3", CheckpointKind::kFull, true).code(), absl::StatusCode::kAlreadyExists);
  auto list = a.client->ListCheckpoints();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_TRUE((*list)[0].complete);
  EXPECT_EQ((*list)[0].versions.at("big"), 3);

  testing::TestCluster two(2, "tok", ::testing::TempDir(), root);
  for (const char* name : {"sharded-3", "full-3"}) {
    Trainer b(two);
    const absl::Status loaded = b.client->LoadCheckpoint(name);
    ASSERT_TRUE(loaded.ok()) << name << ": " << loaded;
    EXPECT_EQ(*b.client->WaitVersion("big", 0), 3);
    EXPECT_EQ(b.Params("big", b.big, 3), a.Params("big", a.big, 3)) << name;
    EXPECT_EQ(b.Params("tiny", b.tiny, 3), a.Params("tiny", a.tiny, 3)) << name;
  }
  // Training continues to the same result (optimizer state and step counts came along).
  Trainer b(two);
  ASSERT_TRUE(b.client->LoadCheckpoint("sharded-3").ok());
  for (int step = 3; step < 5; ++step) {
    a.Step(step);
    b.Step(step);
  }
  EXPECT_EQ(b.Params("big", b.big, 5), a.Params("big", a.big, 5));
  EXPECT_EQ(b.Params("tiny", b.tiny, 5), a.Params("tiny", a.tiny, 5));

  // A mismatched cluster is refused and keeps its state.
  std::filesystem::remove(root + "/sharded-3/shard-2.safetensors");
  absl::Status missing = b.client->LoadCheckpoint("sharded-3");
  EXPECT_FALSE(missing.ok());
  EXPECT_EQ(*b.client->WaitVersion("big", 0), 5);
  ASSERT_TRUE(b.client->DeleteCheckpoint("sharded-3").ok());
  EXPECT_EQ(b.client->LoadCheckpoint("sharded-3").code(), absl::StatusCode::kNotFound);
}

// A non-strict load (fine-tuning from another model's checkpoint) through the client and
// `flatshard load --non_strict`: what the checkpoint holds loads, a group it lacks keeps
// its values and moves to the loaded version, and what was left out is returned and
// printed; a strict load of the same checkpoint is refused and changes nothing.
TEST(CheckpointIntegrationTest, NonStrictLoadsWhatItHoldsAndSaysWhatItLeftOut) {
  const testing::ScratchDir root_dir("ckpt-non-strict");
  const std::string& root = root_dir.path();
  testing::TestCluster three(3, "tok", ::testing::TempDir(), root);
  Trainer a(three);
  ASSERT_TRUE(a.client->InitGroupFromSeed("big", 3).ok());
  ASSERT_TRUE(a.client->InitGroupFromSeed("tiny", 3).ok());
  ASSERT_TRUE(a.client->RegisterGroup("old", {{"old.head", {3}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
  for (int step = 0; step < 2; ++step) a.Step(step);
  ASSERT_TRUE(a.client->SaveCheckpoint("pretrained", CheckpointKind::kFull, false).ok());

  testing::TestCluster two(2, "tok", ::testing::TempDir(), root);
  Trainer b(two);
  auto fresh = b.client->RegisterGroup("fresh", {{"new.head", {4}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE(b.client->InitGroupFromSeed("fresh", 5).ok());
  const std::vector<float> head = b.Params("fresh", *fresh, 0);
  const absl::Status strict = b.client->LoadCheckpoint("pretrained");
  EXPECT_TRUE(absl::IsFailedPrecondition(strict)) << strict;
  EXPECT_THAT(std::string(strict.message()),
              HasSubstr("tensor 'new.head' of group 'fresh' of job 'test' is not in checkpoint 'pretrained'"));
  EXPECT_EQ(*b.client->WaitVersion("big", 0), 0);

  const absl::StatusOr<IncompatibleTensors> omitted = b.client->LoadCheckpointNonStrict("pretrained");
  ASSERT_TRUE(omitted.ok()) << omitted.status();
  EXPECT_EQ(omitted->missing, std::vector<std::string>{"new.head"});
  EXPECT_EQ(omitted->unexpected, std::vector<std::string>{"old.head"});
  EXPECT_EQ(b.Params("big", b.big, 2), a.Params("big", a.big, 2));
  EXPECT_EQ(b.Params("tiny", b.tiny, 2), a.Params("tiny", a.tiny, 2));
  EXPECT_EQ(b.Params("fresh", *fresh, 2), head);  // at the loaded version, as it was

  cli::CheckpointCommandOptions command;
  command.command = "load";
  command.servers = two.addresses();
  command.token = "tok";
  command.job = "test";
  command.name = "pretrained";
  command.non_strict = true;
  std::ostringstream out, err;
  EXPECT_EQ(cli::RunCheckpointCommand(command, out, err), 0) << err.str();
  EXPECT_THAT(out.str(), HasSubstr("load 'pretrained': done in"));
  EXPECT_THAT(out.str(), HasSubstr("\nmissing (not in the checkpoint, kept as they were): new.head\n"
                                   "unexpected (no group registers them, not loaded): old.head\n"));
  command.command = "save";
  EXPECT_EQ(cli::RunCheckpointCommand(command, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("flatshard save: --non_strict applies to load only"));
}

// Each server with a root of its own (no shared file system): LOCAL checkpoints save
// (blocking and async), list, load and delete per server.
// A frozen group (parameters never trained: FrozenOptions) through real servers: it is
// initialized and gathered like any group, refuses gradients with a precise status while
// the job's other groups train on, and round-trips through a checkpoint with optimizer
// state (it has none) into a fresh cluster.
// Whole files, for comparing two checkpoints' bytes.
std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// HYBRID_SHARD: 4 servers in 2 replica groups of 2, one worker in each. Replica group 0
// writes the checkpoints, which are those of a cluster of 2: every kind loads into a
// plain cluster of 2, a load into the hybrid cluster fills both replica groups, and an
// export reads one replica group.
TEST(CheckpointIntegrationTest, HybridShardedJobCheckpointsAreThoseOfOneReplicaGroup) {
  const testing::ScratchDir root_dir("ckpt-hybrid");
  const std::string& root = root_dir.path();
  testing::TestCluster four(4, "tok", ::testing::TempDir(), root);
  const JobOptions hybrid{.replicas = 2};
  Trainer first(four, 0, 2, hybrid), second(four, 1, 2, hybrid);
  ASSERT_EQ(first.big->num_shards(), 2);
  ASSERT_TRUE(first.client->InitGroupFromSeed("big", 5).ok());
  ASSERT_TRUE(first.client->InitGroupFromSeed("tiny", 5).ok());
  auto step = [&](int64_t s) {
    first.Step(s);
    second.Step(s);
  };
  for (int64_t s = 0; s < 3; ++s) step(s);
  const std::vector<float> big = first.Params("big", first.big, 3);
  const std::vector<float> tiny = first.Params("tiny", first.tiny, 3);
  ASSERT_EQ(second.Params("big", second.big, 3), big) << "replica groups diverged";

  for (auto [name, kind] : {std::pair{"h-full", CheckpointKind::kFull}, std::pair{"h-sharded", CheckpointKind::kSharded},
                            std::pair{"h-local", CheckpointKind::kLocal}}) {
    const absl::Status saved = second.client->SaveCheckpoint(name, kind, true);
    ASSERT_TRUE(saved.ok()) << name << ": " << saved;
  }
  // Asynchronous: the last of replica group 0's servers to finish commits.
  ASSERT_TRUE(second.client->SaveCheckpoint("h-async", CheckpointKind::kFull, true, /*async=*/true).ok());
  absl::StatusOr<std::vector<CheckpointEntry>> entries;
  for (int poll = 0; poll < 200; ++poll) {
    entries = first.client->ListCheckpoints();
    ASSERT_TRUE(entries.ok()) << entries.status();
    if (std::all_of(entries->begin(), entries->end(), [](const CheckpointEntry& e) { return e.complete; })) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(entries->size(), 4u);
  EXPECT_EQ(ReadWholeFile(root + "/h-async/model.safetensors"), ReadWholeFile(root + "/h-full/model.safetensors"));
  for (const CheckpointEntry& entry : *entries) {
    EXPECT_TRUE(entry.complete) << entry.name;
    EXPECT_EQ(entry.servers, 2) << entry.name;
  }
  EXPECT_TRUE(std::filesystem::exists(root + "/h-sharded/shard-1.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(root + "/h-sharded/shard-2.safetensors"));
  const testing::ScratchDir exported_dir("export-hybrid");
  const std::string& exported = exported_dir.path();
  ASSERT_TRUE(second.client->ExportStateDict(exported, CheckpointKind::kFull, true).ok());
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(ReadWholeFile(exported + "/" + file), ReadWholeFile(root + "/h-full/" + file)) << file;
  }

  {
    testing::TestCluster two(2, "tok", ::testing::TempDir(), root);
    for (const char* name : {"h-full", "h-sharded", "h-local"}) {
      Trainer plain(two);
      const absl::Status loaded = plain.client->LoadCheckpoint(name);
      ASSERT_TRUE(loaded.ok()) << name << ": " << loaded;
      EXPECT_EQ(plain.Params("big", plain.big, 3), big) << name;
      EXPECT_EQ(plain.Params("tiny", plain.tiny, 3), tiny) << name;
    }
  }

  // Trained on, then loaded back: both replica groups return to step 3 and train on
  // together.
  for (int64_t s = 3; s < 5; ++s) step(s);
  ASSERT_NE(first.Params("big", first.big, 5), big);
  for (const char* name : {"h-local", "h-sharded"}) {
    const absl::Status loaded = first.client->LoadCheckpoint(name);
    ASSERT_TRUE(loaded.ok()) << name << ": " << loaded;
    // Each worker gathers what it trains on from the loaded state, as a worker must: a
    // gradient computed from the state the load replaced is refused.
    EXPECT_EQ(first.Params("big", first.big, 3), big) << name;
    EXPECT_EQ(first.Params("tiny", first.tiny, 3), tiny) << name;
    EXPECT_EQ(second.Params("big", second.big, 3), big) << name;
    EXPECT_EQ(second.Params("tiny", second.tiny, 3), tiny) << name;
  }
  step(3);
  EXPECT_EQ(first.Params("big", first.big, 4), second.Params("big", second.big, 4));
  EXPECT_NE(first.Params("big", first.big, 4), big);
}

TEST(CheckpointIntegrationTest, AFrozenGroupRefusesGradientsAndRoundTrips) {
  const testing::ScratchDir root_dir("ckpt-frozen");
  const std::string& root = root_dir.path();
  std::vector<float> frozen_values(42);
  for (size_t i = 0; i < frozen_values.size(); ++i) frozen_values[i] = 0.25f * static_cast<float>(i) - 3.0f;
  const std::vector<TensorSpec> backbone = {{"backbone.weight", {6, 7}, DType::kFloat32}};
  std::vector<float> trained_after;
  {
    testing::TestCluster three(3, "tok", ::testing::TempDir(), root);
    Trainer a(three);
    auto frozen = a.client->RegisterGroup("backbone", backbone, 0, FrozenOptions{});
    ASSERT_TRUE(frozen.ok()) << frozen.status();
    ASSERT_TRUE(a.client->InitGroup("backbone", frozen_values).ok());
    ASSERT_TRUE(a.client->InitGroupFromSeed("big", 3).ok());
    std::vector<float> grad((*frozen)->padded_numel(), 1.0f);
    const absl::Status refused = a.client->Scatter("backbone", 0, DType::kFloat32, AsBytes(grad)).get();
    EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("group 'backbone' of job 'test' is frozen"));
    EXPECT_EQ(a.client->SetHyperparams("backbone", SgdOptions{.lr = 0.1}).code(),
              absl::StatusCode::kFailedPrecondition);
    for (int64_t step = 0; step < 2; ++step) a.Step(step);  // the other groups train on
    EXPECT_EQ(*a.client->WaitVersion("big", 2), 2);
    EXPECT_EQ(a.Params("backbone", *frozen, 0), frozen_values);
    trained_after = a.Params("big", a.big, 2);
    const std::vector<absl::StatusOr<v1::ServerStatus>> statuses = FetchClusterStatus(
        ClientOptions{.servers = three.addresses(), .token = "tok"});
    bool listed = false;
    for (const v1::GroupStatus& group : statuses[0]->groups()) {
      if (group.group() == "backbone") listed = group.optimizer() == "frozen";
    }
    EXPECT_TRUE(listed) << statuses[0]->DebugString();
    ASSERT_TRUE(a.client->SaveCheckpoint("with-frozen", CheckpointKind::kFull, true).ok());
  }
  testing::TestCluster two(2, "tok", ::testing::TempDir(), root);
  Trainer b(two);
  auto frozen = b.client->RegisterGroup("backbone", backbone, 0, FrozenOptions{});
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  ASSERT_TRUE(b.client->LoadCheckpoint("with-frozen").ok());
  EXPECT_EQ(b.Params("backbone", *frozen, 0), frozen_values);
  EXPECT_EQ(b.Params("big", b.big, 2), trained_after);
}

TEST(CheckpointIntegrationTest, LocalCheckpointsWorkWithARootPerServer) {
  const testing::ScratchDir root_dirs[2] = {testing::ScratchDir("own-root-0"), testing::ScratchDir("own-root-1")};
  const std::vector<std::string> roots = {root_dirs[0].path(), root_dirs[1].path()};
  std::vector<std::vector<std::string>> args;
  for (const std::string& root : roots) args.push_back({"--checkpoint_root=" + root});
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), "", args);
  Trainer a(cluster);
  ASSERT_TRUE(a.client->InitGroupFromSeed("big", 5).ok());
  ASSERT_TRUE(a.client->InitGroupFromSeed("tiny", 5).ok());
  for (int step = 0; step < 2; ++step) a.Step(step);
  ASSERT_TRUE(a.client->SaveCheckpoint("mine", CheckpointKind::kLocal, true).ok());
  for (const std::string& root : roots) {
    EXPECT_TRUE(std::filesystem::exists(root + "/mine/manifest.json")) << root;
  }
  auto list = a.client->ListCheckpoints();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_TRUE((*list)[0].complete);

  // Async: each server commits its own part once written.
  ASSERT_TRUE(a.client->SaveCheckpoint("mine-async", CheckpointKind::kLocal, true, /*async=*/true).ok());
  bool committed = false;
  for (int tries = 0; tries < 200 && !committed; ++tries) {
    committed = true;
    for (const std::string& root : roots) committed &= std::filesystem::exists(root + "/mine-async/manifest.json");
    if (!committed) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(committed) << "the async LOCAL save was not committed on every server within 10 s";

  const auto saved_big = a.Params("big", a.big, 2);
  for (int step = 2; step < 4; ++step) a.Step(step);
  for (const char* name : {"mine", "mine-async"}) {
    ASSERT_TRUE(a.client->LoadCheckpoint(name).ok()) << name;
    EXPECT_EQ(*a.client->WaitVersion("big", 0), 2);
    EXPECT_EQ(a.Params("big", a.big, 2), saved_big) << name;
  }

  ASSERT_TRUE(a.client->DeleteCheckpoint("mine").ok());
  for (const std::string& root : roots) EXPECT_FALSE(std::filesystem::exists(root + "/mine")) << root;
}

// Roots that differ: FULL and SHARDED checkpoints are kept whole in server 0's root. Here
// servers 0 and 1 share root A and server 2 has root B: server 2 streams its part to
// server 0. Then a cluster of 2 whose server 1 has a root of its own (C) loads them,
// reading from server 0, and refuses a damaged byte that only server 1 reads.
TEST(CheckpointIntegrationTest, FullAndShardedCheckpointsGoToServerZerosRootWhenRootsDiffer) {
  const testing::ScratchDir a_dir("root-a"), b_dir("root-b"), c_dir("root-c");
  const std::string &a_root = a_dir.path(), &b_root = b_dir.path(), &c_root = c_dir.path();
  testing::TestCluster three(3, "tok", ::testing::TempDir(), "",
                             {{"--checkpoint_root=" + a_root}, {"--checkpoint_root=" + a_root},
                              {"--checkpoint_root=" + b_root}});
  Trainer a(three);
  ASSERT_TRUE(a.client->InitGroupFromSeed("big", 7).ok());
  ASSERT_TRUE(a.client->InitGroupFromSeed("tiny", 7).ok());
  for (int step = 0; step < 2; ++step) a.Step(step);
  ASSERT_TRUE(a.client->SaveCheckpoint("full", CheckpointKind::kFull, true).ok());
  ASSERT_TRUE(a.client->SaveCheckpoint("sharded", CheckpointKind::kSharded, true).ok());
  ASSERT_TRUE(a.client->SaveCheckpoint("async", CheckpointKind::kSharded, true, /*async=*/true).ok());
  const auto saved_big = a.Params("big", a.big, 2);
  const auto saved_tiny = a.Params("tiny", a.tiny, 2);
  bool committed = false;
  for (int tries = 0; tries < 200 && !committed; ++tries) {
    committed = std::filesystem::exists(a_root + "/async/manifest.json");
    if (!committed) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(committed) << "the async save was not committed in server 0's root within 10 s";
  for (const char* name : {"full", "sharded", "async"}) {
    EXPECT_FALSE(std::filesystem::exists(b_root + "/" + name)) << name;
    EXPECT_FALSE(std::filesystem::exists(b_root + "/." + name + ".partial")) << name;
  }
  EXPECT_TRUE(std::filesystem::exists(a_root + "/sharded/shard-2.safetensors"));
  // The FULL file is a whole safetensors file in root A: server 2's bytes are in it.
  auto header = SafetensorsHeader::Read(a_root + "/full/model.safetensors");
  ASSERT_TRUE(header.ok()) << header.status();
  const SafetensorsTensor* bias = header->Find("fc.bias");
  ASSERT_NE(bias, nullptr);
  std::vector<float> stored(7);
  {
    std::ifstream in(a_root + "/full/model.safetensors", std::ios::binary);
    in.seekg(static_cast<std::streamoff>(header->data_start() + bias->begin));
    in.read(reinterpret_cast<char*>(stored.data()), 7 * sizeof(float));
  }
  EXPECT_EQ(stored, std::vector<float>(saved_big.end() - 7, saved_big.end()));
  auto list = a.client->ListCheckpoints();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 3u);
  for (const auto& entry : *list) EXPECT_TRUE(entry.complete) << entry.name;

  // Server 2 reads its pieces back from server 0.
  for (int step = 2; step < 4; ++step) a.Step(step);
  for (const char* name : {"full", "sharded", "async"}) {
    ASSERT_TRUE(a.client->LoadCheckpoint(name).ok()) << name;
    EXPECT_EQ(*a.client->WaitVersion("big", 0), 2) << name;
    EXPECT_EQ(a.Params("big", a.big, 2), saved_big) << name;
    EXPECT_EQ(a.Params("tiny", a.tiny, 2), saved_tiny) << name;
  }

  // 3 -> 2 servers, server 1 with a root of its own: resharded reads from server 0.
  testing::TestCluster two(2, "tok", ::testing::TempDir(), "",
                           {{"--checkpoint_root=" + a_root}, {"--checkpoint_root=" + c_root}});
  Trainer b(two);
  for (const char* name : {"full", "sharded"}) {
    const absl::Status loaded = b.client->LoadCheckpoint(name);
    ASSERT_TRUE(loaded.ok()) << name << ": " << loaded;
    EXPECT_EQ(b.Params("big", b.big, 2), saved_big) << name;
    EXPECT_EQ(b.Params("tiny", b.tiny, 2), saved_tiny) << name;
  }
  for (int step = 2; step < 4; ++step) {  // `a` is back at version 2 too
    a.Step(step);
    b.Step(step);
  }
  EXPECT_EQ(b.Params("big", b.big, 4), a.Params("big", a.big, 4));  // optimizer state came along

  // A flipped byte in the last shard, whose pieces only server 1 (reading remotely)
  // needs: refused with the file named, and the cluster keeps its state.
  {
    auto last = SafetensorsHeader::Read(a_root + "/sharded/shard-2.safetensors");
    ASSERT_TRUE(last.ok()) << last.status();
    std::fstream f(a_root + "/sharded/shard-2.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(last->data_start()));
    f.put('\x7f');
  }
  absl::Status damaged = b.client->LoadCheckpoint("sharded");
  EXPECT_EQ(damaged.code(), absl::StatusCode::kDataLoss) << damaged;
  EXPECT_THAT(std::string(damaged.message()), HasSubstr("shard-2.safetensors"));
  EXPECT_THAT(std::string(damaged.message()), HasSubstr("server 0"));
  EXPECT_EQ(*b.client->WaitVersion("big", 0), 4);
  EXPECT_EQ(b.client->LoadCheckpoint("no-such").code(), absl::StatusCode::kNotFound);

  // The server-to-server RPCs refuse bad input with a precise status.
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(two.addresses()[0], grpc::InsecureChannelCredentials()));
  auto read = [&](const std::string& name, const std::string& file, uint64_t offset, uint64_t length) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer tok");
    v1::ReadCheckpointFileRequest request;
    request.set_name(name);
    request.set_file(file);
    request.set_offset(offset);
    request.set_length(length);
    auto reader = stub->ReadCheckpointFile(&ctx, request);
    v1::ReadCheckpointFileChunk chunk;
    uint64_t got = 0;
    while (reader->Read(&chunk)) got += chunk.data().size();
    const grpc::Status status = reader->Finish();
    return std::pair{status, got};
  };
  EXPECT_EQ(read("full", "model.safetensors", 8, 100).second, 100u);
  EXPECT_EQ(read("..", "manifest.json", 0, 0).first.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(read("full", "../full/manifest.json", 0, 0).first.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(read("full", "nope", 0, 0).first.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(read("no-such", "manifest.json", 0, 0).first.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(read("full", "model.safetensors", uint64_t{1} << 40, 1).first.error_code(), grpc::StatusCode::DATA_LOSS);
  auto write_part = [&](const std::string& name, const std::string& file, int rank) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer tok");
    v1::WriteCheckpointPartResponse response;
    auto writer = stub->WriteCheckpointPart(&ctx, &response);
    v1::CheckpointPartMessage message;
    message.set_name(name);
    message.set_rank(rank);
    writer->Write(message);
    message.Clear();
    message.set_open(true);
    message.mutable_chunk()->set_file(file);
    message.mutable_chunk()->set_file_size(4);
    message.mutable_chunk()->set_data("abcd");
    message.mutable_chunk()->set_close(true);
    writer->Write(message);
    message.Clear();
    message.set_part(R"({"files": []})");
    writer->Write(message);
    writer->WritesDone();
    return writer->Finish();
  };
  EXPECT_EQ(write_part("evil", "../escaped", 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(std::filesystem::exists(a_root + "/escaped"));
  EXPECT_EQ(write_part("evil", "ok", 9).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(write_part("full", "ok", 1).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  ASSERT_TRUE(b.client->LoadCheckpoint("full").ok());  // still serving

  ASSERT_TRUE(b.client->DeleteCheckpoint("evil").ok());
  ASSERT_TRUE(b.client->DeleteCheckpoint("full").ok());
  EXPECT_FALSE(std::filesystem::exists(a_root + "/full"));
}

// Blocking saves and loads report the servers' bytes as they go: never more than the
// total, never backwards, and done = total at the end, the total being exactly the
// tensor bytes of the checkpoint (768 MiB here: a few progress polls at least).
TEST(CheckpointIntegrationTest, SavesAndLoadsReportProgress) {
  const testing::ScratchDir root_dir("ckpt-progress");
  const std::string& root = root_dir.path();
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root);
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  const int64_t numel = int64_t{64} << 20;
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {numel}, DType::kFloat32}}, 0, kAdam).ok());
  ASSERT_TRUE((*client)->InitGroupFromSeed("g", 4).ok());
  const uint64_t expected = 3 * static_cast<uint64_t>(numel) * sizeof(float);  // params, exp_avg, exp_avg_sq
  for (const char* operation : {"save", "load"}) {
    std::vector<std::pair<uint64_t, uint64_t>> calls;
    auto record = [&](uint64_t done, uint64_t total) { calls.emplace_back(done, total); };
    const absl::Status status = std::string(operation) == "save"
                                    ? (*client)->SaveCheckpoint("p", CheckpointKind::kSharded, true, false, record)
                                    : (*client)->LoadCheckpoint("p", record);
    ASSERT_TRUE(status.ok()) << operation << ": " << status;
    ASSERT_FALSE(calls.empty()) << operation;
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_LE(calls[i].first, calls[i].second) << operation << " call " << i;
      EXPECT_LE(calls[i].second, expected) << operation << " call " << i;
      if (i > 0) {
        EXPECT_GE(calls[i].first, calls[i - 1].first) << operation << " call " << i;
      }
    }
    EXPECT_EQ(calls.back().first, calls.back().second) << operation;
    std::cout << operation << ": " << calls.size() << " progress reports, last total " << calls.back().second
              << " of " << expected << " bytes\n";
  }
}

TEST(CheckpointIntegrationTest, ServersWithoutARootSaySo) {
  testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  Trainer t(cluster);
  absl::Status status = t.client->SaveCheckpoint("x", CheckpointKind::kFull, false);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("no --checkpoint_root"));
}

}  // namespace
}  // namespace flatshard

namespace flatshard {
namespace {

TEST(CheckpointIntegrationTest, AsyncSaveIsAConsistentCutWhileTrainingContinues) {
  const testing::ScratchDir root_dir("ckpt-async");
  const std::string& root = root_dir.path();
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root);
  Trainer a(cluster);
  ASSERT_TRUE(a.client->InitGroupFromSeed("big", 5).ok());
  ASSERT_TRUE(a.client->InitGroupFromSeed("tiny", 5).ok());
  a.Step(0);
  const std::vector<float> at_one = a.Params("big", a.big, 1);
  ASSERT_TRUE(a.client->SaveCheckpoint("async", CheckpointKind::kSharded, true, /*async=*/true).ok());
  a.Step(1);  // training goes on while the servers write
  bool complete = false;
  for (int attempt = 0; attempt < 100 && !complete; ++attempt) {
    auto list = a.client->ListCheckpoints();
    ASSERT_TRUE(list.ok());
    complete = !list->empty() && (*list)[0].complete;
    if (!complete) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(complete);
  ASSERT_TRUE(a.client->LoadCheckpoint("async").ok());
  EXPECT_EQ(*a.client->WaitVersion("big", 0), 1);
  EXPECT_EQ(a.Params("big", a.big, 1), at_one);  // version 1, not the step after it
}

}  // namespace
}  // namespace flatshard

namespace flatshard {
namespace {

// A worker's Client outlives a server restart: once the job is configured, its group
// registered and a checkpoint loaded again (the restarted server comes back empty), the
// same Client gathers and scatters on. Its idle data connections to the old process are
// replaced, and the session the new process does not know is opened again, also when
// the server comes back on another data port.
class ServerRestartTest : public ::testing::TestWithParam<bool> {};

TEST_P(ServerRestartTest, AClientOutlivesIt) {
  const bool new_data_port = GetParam();
  const testing::ScratchDir root_dir(new_data_port ? "ckpt-restart-port" : "ckpt-restart");
  const std::string& root = root_dir.path();
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root);
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<TensorSpec> tensors = {{"w", {1000}, DType::kFloat32}, {"b", {7}, DType::kFloat32}};
  auto setup = [&] {
    absl::Status configured;
    for (int attempt = 0; attempt < 100; ++attempt) {  // while the server starts
      configured = (*client)->ConfigureJob({});
      if (!absl::IsUnavailable(configured)) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!configured.ok()) return configured;
    return (*client)->RegisterGroup("g", tensors, 0, AdamOptions{.lr = 0.01}).status();
  };
  ASSERT_TRUE(setup().ok());
  const FlatLayout& layout = **(*client)->RegisterGroup("g", tensors, 0, AdamOptions{.lr = 0.01});
  ASSERT_TRUE((*client)->InitGroupFromSeed("g", 3).ok());
  std::vector<float> grad(layout.padded_numel(), 0.25f);  // padding too: it must not count
  ASSERT_TRUE((*client)->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  std::vector<float> saved(layout.padded_numel());
  ASSERT_EQ((*client)->Gather("g", 1, DType::kFloat32, AsBytes(saved)).get().value_or(-1), 1);
  ASSERT_TRUE((*client)->SaveCheckpoint("before-restart", CheckpointKind::kSharded, true).ok());

  cluster.Restart(1, new_data_port ? transport::PickFreeLoopbackPorts(1)->at(0) : 0);
  ASSERT_TRUE(setup().ok());
  ASSERT_TRUE((*client)->LoadCheckpoint("before-restart").ok());
  std::vector<float> loaded(layout.padded_numel(), -1.0f);
  absl::StatusOr<int64_t> version = (*client)->Gather("g", 0, DType::kFloat32, AsBytes(loaded)).get();
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 1);
  EXPECT_EQ(std::memcmp(loaded.data(), saved.data(), saved.size() * sizeof(float)), 0);
  ASSERT_TRUE((*client)->Scatter("g", 1, DType::kFloat32, AsBytes(grad)).get().ok());
  EXPECT_EQ((*client)->Gather("g", 2, DType::kFloat32, AsBytes(loaded)).get().value_or(-1), 2);
}

INSTANTIATE_TEST_SUITE_P(SameOrNewDataPort, ServerRestartTest, ::testing::Bool());

TEST(CheckpointIntegrationTest, ServerKilledMidSaveLeavesThePreviousCheckpointIntact) {
  const testing::ScratchDir root_dir("ckpt-kill");
  const std::string& root = root_dir.path();
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root);
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  // 256 MiB of parameters: a save takes long enough to be interrupted.
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {int64_t{64} << 20}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
  ASSERT_TRUE((*client)->InitGroupFromSeed("g", 2).ok());
  ASSERT_TRUE((*client)->SaveCheckpoint("before", CheckpointKind::kSharded, false).ok());

  absl::Status interrupted;
  std::thread saver([&] { interrupted = (*client)->SaveCheckpoint("interrupted", CheckpointKind::kFull, false); });
  absl::SleepFor(absl::Milliseconds(60));
  kill(cluster.pid(1), SIGKILL);
  saver.join();

  std::cout << "save during SIGKILL: " << interrupted << "\n";
  std::filesystem::path interrupted_dir = root + "/interrupted";
  if (!interrupted.ok()) {
    // Never committed: no manifest, not listed as complete.
    EXPECT_FALSE(std::filesystem::exists(interrupted_dir / "manifest.json"));
  }
  // The earlier checkpoint is whole: a fresh cluster of one server loads it.
  testing::TestCluster fresh(1, "tok", ::testing::TempDir(), root);
  auto other = fresh.Connect(0, 1);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->ConfigureJob({}).ok());
  ASSERT_TRUE((*other)->RegisterGroup("g", {{"w", {int64_t{64} << 20}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).ok());
  ASSERT_TRUE((*other)->LoadCheckpoint("before").ok());
  auto list = (*other)->ListCheckpoints();
  ASSERT_TRUE(list.ok());
  for (const CheckpointEntry& entry : *list) {
    if (entry.name == "before") {
      EXPECT_TRUE(entry.complete);
    } else if (entry.name == "interrupted") {
      EXPECT_EQ(entry.complete, interrupted.ok());
    }
  }
}

// A worker saves (then exports) right after its step while the other worker is still
// inside that step ("big" has taken it, "tiny" not yet): the save waits for "tiny" and
// holds the state after the step, not a cut inside it; so does the export.
TEST(CheckpointIntegrationTest, ASaveOrExportRightAfterAStepCutsAfterIt) {
  const testing::ScratchDir root("ckpt-after-step");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  Trainer first(cluster, 0, 2), second(cluster, 1, 2);
  ASSERT_TRUE(first.client->InitGroupFromSeed("big", 3).ok());
  ASSERT_TRUE(first.client->InitGroupFromSeed("tiny", 3).ok());
  // Runs `operation` from the first worker once it has sent `step` and the second worker
  // has sent only "big"; the operation must still be running when "tiny" follows.
  auto after_step = [&](int64_t step, const std::function<absl::Status()>& operation) {
    first.Step(step);
    second.Send("big", step);
    EXPECT_TRUE(first.client->WaitVersion("big", step + 1).ok());
    return testing::MustWaitFor(
        operation, [&] { second.Send("tiny", step); }, absl::StrCat("'tiny' to take step ", step));
  };
  const absl::Status saved =
      after_step(0, [&] { return first.client->SaveCheckpoint("after-0", CheckpointKind::kSharded, true); });
  ASSERT_TRUE(saved.ok()) << saved;
  const std::vector<float> big = first.Params("big", first.big, 1), tiny = first.Params("tiny", first.tiny, 1);
  auto listed = first.client->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().versions, (std::map<std::string, int64_t>{{"big", 1}, {"tiny", 1}}));

  const testing::ScratchDir exported("export-after-step");
  const absl::Status streamed =
      after_step(1, [&] { return first.client->ExportStateDict(exported.path(), CheckpointKind::kFull, false); });
  ASSERT_TRUE(streamed.ok()) << streamed;
  ASSERT_TRUE(first.client->SaveCheckpoint("after-1", CheckpointKind::kFull, false).ok());  // at {2, 2}: no wait
  EXPECT_EQ(ReadWholeFile(exported.path() + "/model.safetensors"),
            ReadWholeFile(root.path() + "/after-1/model.safetensors"));

  ASSERT_TRUE(second.client->LoadCheckpoint("after-0").ok());
  EXPECT_EQ(first.Params("big", first.big, 1), big);
  EXPECT_EQ(first.Params("tiny", first.tiny, 1), tiny);
}

// A worker saves inside its own step (it sent "big", not yet "tiny") in a job that clips:
// no group can step before its gradient of "tiny" arrives, so the save must not wait for
// the step. It saves the versions as they are, and training then goes on. A save after
// a step that another worker never completes fails at the deadline, saying why.
TEST(CheckpointIntegrationTest, ASaveInsideTheSaversOwnStepDoesNotWaitForIt) {
  const testing::ScratchDir root("ckpt-inside-step");
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
  const JobOptions clipped{.max_grad_norm = 1.0};
  Trainer first(cluster, 0, 2, clipped, absl::Seconds(5)), second(cluster, 1, 2, clipped);
  first.Send("big", 0);
  second.Step(0);
  const absl::Status saved = first.client->SaveCheckpoint("inside-0", CheckpointKind::kLocal, true);
  ASSERT_TRUE(saved.ok()) << saved;
  auto listed = first.client->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().versions, (std::map<std::string, int64_t>{{"big", 0}, {"tiny", 0}}));
  first.Send("tiny", 0);
  auto stepped = first.client->WaitVersion("big", 1);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  first.Step(1);  // the other worker never sends step 1
  const absl::Status stuck = first.client->SaveCheckpoint("after-1", CheckpointKind::kLocal, true);
  EXPECT_TRUE(absl::IsDeadlineExceeded(stuck)) << stuck;
  // The servers gave up first, said why, and let go of the name before the client did.
  EXPECT_THAT(std::string(stuck.message()), HasSubstr("timed out waiting for version 2"));
  EXPECT_THAT(std::string(stuck.message()), HasSubstr("is a worker behind or gone?"));
  ASSERT_TRUE(testing::AwaitNoCheckpointInProgress(cluster));
  second.Step(1);
  stepped = first.client->WaitVersion("tiny", 2);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  const absl::Status saved_after = first.client->SaveCheckpoint("after-1", CheckpointKind::kLocal, true);
  EXPECT_TRUE(saved_after.ok()) << saved_after;
}

using SaveStream = grpc::ClientReaderWriter<v1::SaveCheckpointStep, v1::SaveAnswer>;

// A SaveCheckpoint stream to `stub` (token "tok") whose first step asks for a blocking
// FULL save "x" of job "test" (groups "big" and "tiny") at `version`.
std::unique_ptr<SaveStream> OpenSave(v1::Flatshard::Stub& stub, grpc::ClientContext& ctx, const std::string& save_id,
                                     int64_t version) {
  ctx.AddMetadata("authorization", "Bearer tok");
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub.SaveCheckpoint(&ctx);
  v1::SaveCheckpointStep step;
  v1::SaveCheckpointRequest& request = *step.mutable_request();
  request.set_name("x");
  request.set_kind(v1::FULL);
  request.set_job("test");
  request.set_save_id(save_id);
  (*request.mutable_versions())["big"] = version;
  (*request.mutable_versions())["tiny"] = version;
  EXPECT_TRUE(stream->Write(step));
  return stream;
}

v1::SaveCheckpointStep WriteStep() {
  v1::SaveCheckpointStep write;
  write.set_write(true);
  return write;
}

// The servers' side of a save's rounds (SaveCheckpoint stream), spoken directly: a
// server answers a cut that training has passed with its versions and refuses to write
// it; a client that goes away once a server has pinned the cut leaves nothing pinned
// (training goes on), nothing on disk and the name free.
TEST(CheckpointIntegrationTest, ASaveStreamPinsBeforeItWritesAndLeavesNothingBehind) {
  const testing::ScratchDir root("ckpt-stream");
  testing::TestCluster cluster(1, "tok", ::testing::TempDir(), root.path());
  Trainer trainer(cluster);
  trainer.Step(0);
  ASSERT_TRUE(trainer.client->WaitVersion("big", 1).ok());
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    auto stream = OpenSave(*stub, ctx, "s1", 0);
    v1::SaveAnswer answer;
    ASSERT_TRUE(stream->Read(&answer));
    EXPECT_FALSE(answer.cut().pinned());
    EXPECT_EQ(answer.cut().versions().at("big"), 1);
    EXPECT_TRUE(stream->Write(WriteStep()));
    const grpc::Status refused = stream->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(refused.error_message(), HasSubstr("a cut this server did not pin"));
  }
  {
    grpc::ClientContext ctx;
    auto stream = OpenSave(*stub, ctx, "s1", 1);
    v1::SaveAnswer answer;
    ASSERT_TRUE(stream->Read(&answer));
    EXPECT_TRUE(answer.cut().pinned());
    ctx.TryCancel();  // the client goes away, its cut pinned
    EXPECT_FALSE(stream->Finish().ok());
  }
  trainer.Step(1);  // waits for no pin
  auto reached = trainer.client->WaitVersion("big", 2);
  ASSERT_TRUE(reached.ok()) << reached.status();
  auto listed = trainer.client->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << listed->front().name;  // not even an incomplete one
  EXPECT_TRUE(trainer.client->SaveCheckpoint("x", CheckpointKind::kFull, true).ok());
}

// A blocking save's part is written, and the server holds the name until the client says
// commit: another caller's save of it is refused meanwhile (an async one would be told
// OK, then lose to the commit), while training goes on. A client that goes away before
// it commits leaves nothing (no commit can come: the server removes the part) and the
// name free.
TEST(CheckpointIntegrationTest, ABlockingSaveHoldsItsNameUntilItsClientCommits) {
  const testing::ScratchDir root("ckpt-commit");
  testing::TestCluster cluster(1, "tok", ::testing::TempDir(), root.path());
  Trainer trainer(cluster);
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()));
  auto write = [&](SaveStream& stream) {
    v1::SaveAnswer answer;
    EXPECT_TRUE(stream.Read(&answer) && answer.cut().pinned());
    EXPECT_TRUE(stream.Write(WriteStep()));
    EXPECT_TRUE(stream.Read(&answer) && answer.written());
  };
  // The server's status lists the save, written, until it commits.
  auto in_progress = [&] {
    grpc::ClientContext status_ctx;
    status_ctx.AddMetadata("authorization", "Bearer tok");
    v1::ServerStatus status;
    EXPECT_TRUE(stub->GetStatus(&status_ctx, v1::GetStatusRequest(), &status).ok());
    return status.checkpoints_in_progress();
  };
  {
    grpc::ClientContext ctx;
    auto stream = OpenSave(*stub, ctx, "gone", 0);
    write(*stream);
    ctx.TryCancel();  // the client goes away before it commits
    (void)stream->Finish();
  }
  // The server lets go of the save once it sees the cancellation, which the client's
  // Finish does not wait for.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!in_progress().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(in_progress().empty());
  auto listed = trainer.client->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << listed->front().name << " complete: " << listed->front().complete;
  EXPECT_FALSE(std::filesystem::exists(root.path() + "/.x.partial"));
  grpc::ClientContext ctx;
  auto stream = OpenSave(*stub, ctx, "kept", 0);
  write(*stream);
  const auto rows = in_progress();
  ASSERT_EQ(rows.size(), 1);
  EXPECT_EQ(rows[0].name(), "x");
  EXPECT_EQ(rows[0].operation(), "save");
  EXPECT_GT(rows[0].total(), 0u);
  EXPECT_EQ(rows[0].done(), rows[0].total());
  trainer.Step(0);  // the save holds no pins
  ASSERT_TRUE(trainer.client->WaitVersion("big", 1).ok());
  for (const bool async : {true, false}) {
    const absl::Status second = trainer.client->SaveCheckpoint("x", CheckpointKind::kSharded, true, async);
    EXPECT_TRUE(absl::IsAlreadyExists(second)) << second;
    EXPECT_THAT(std::string(second.message()), HasSubstr("'x' is being saved"));
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(trainer.client->DeleteCheckpoint("x")));
  v1::SaveCheckpointStep commit;
  commit.set_commit(true);
  EXPECT_TRUE(stream->Write(commit));
  const grpc::Status committed = stream->Finish();
  ASSERT_TRUE(committed.ok()) << committed.error_message();
  EXPECT_TRUE(in_progress().empty());
  listed = trainer.client->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_TRUE(listed->front().complete);
  EXPECT_EQ(listed->front().kind, "full");
  EXPECT_EQ(listed->front().versions.at("big"), 0);
}

// A server told to stop while a call is in progress (a blocking save waiting for its
// commit) gives that call --shutdown_grace to finish: meanwhile calls that begin are
// refused and health checks answer NOT_SERVING; the save commits whole, and the server
// exits as soon as the call has ended, its idle worker connection notwithstanding.
TEST(ServerShutdownTest, ACallInProgressFinishesWithinTheGraceAndNoNewOneStarts) {
  const testing::ScratchDir root("shutdown-grace");
  testing::TestCluster cluster(1, "tok", ::testing::TempDir(), root.path(), {{"--shutdown_grace=60s"}});
  Trainer trainer(cluster);
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = OpenSave(*stub, ctx, "s", 0);
  v1::SaveAnswer answer;
  ASSERT_TRUE(stream->Read(&answer) && answer.cut().pinned());
  ASSERT_TRUE(stream->Write(WriteStep()));
  ASSERT_TRUE(stream->Read(&answer) && answer.written());
  ASSERT_EQ(kill(cluster.pid(0), SIGTERM), 0);
  grpc::Status refused;
  for (const absl::Time until = absl::Now() + absl::Seconds(20); refused.ok() && absl::Now() < until;) {
    grpc::ClientContext status_ctx;
    status_ctx.AddMetadata("authorization", "Bearer tok");
    v1::ServerStatus status;
    refused = stub->GetStatus(&status_ctx, v1::GetStatusRequest(), &status);
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_EQ(refused.error_message(), "server 0 is shutting down");
  for (const std::string service : {"", "flatshard.v1.Flatshard"}) {
    const auto [checked, serving] = testing::HealthCheck(cluster.addresses()[0], service);
    EXPECT_TRUE(checked.ok()) << checked.error_message();
    EXPECT_EQ(serving, testing::kNotServing) << "'" << service << "'";
  }
  v1::SaveCheckpointStep commit;
  commit.set_commit(true);
  EXPECT_TRUE(stream->Write(commit));
  const grpc::Status committed = stream->Finish();
  EXPECT_TRUE(committed.ok()) << committed.error_message();
  const auto [exit_status, took] = cluster.Terminate(0, absl::Seconds(90));
  EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0) << exit_status;
  EXPECT_LT(took, absl::Seconds(10));  // not the grace's 60 s
  cluster.Restart(0);
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  const auto listed = (*client)->ListCheckpoints();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().name, "x");
  EXPECT_TRUE(listed->front().complete);
}

}  // namespace
}  // namespace flatshard
