// Checkpoints between in-process "servers" (registries sharing one checkpoint root):
// save with N, load with M (and into other groups), compare every tensor and optimizer
// state bitwise; damaged and mismatched checkpoints are refused and leave the groups
// untouched.
#include "server/checkpoint_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/file.h"
#include "core/float_bits.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "tests/file_size_limit.h"
#include "tests/scratch_dir.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct GroupSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
  int64_t align;
  OptimizerConfig optimizer;
};

std::vector<GroupSpec> Specs() {
  return {{"emb", {{"emb.weight", {5, 3}, DType::kFloat32}, {"emb.bias", {7}, DType::kFloat32}}, 4,
           kernels::AdamHyperparams{.lr = 0.01f, .weight_decay = 0.1f, .amsgrad = true,
                                         .decoupled_weight_decay = true}},
          {"tiny", {{"scale", {2}, DType::kFloat32}}, 0,
           kernels::SgdHyperparams{.lr = 0.1f, .momentum = 0.9f}},
          {"half", {{"h.weight", {3, 3}, DType::kBFloat16}}, 0, kernels::AdamHyperparams{.lr = 0.01f}}};
}

// Values by tensor: fqn (+ ".state") -> elements.
using Values = std::map<std::string, std::vector<float>>;

// A gradient element of tensor `fqn` at `step`, the same whichever group holds the tensor.
float Gradient(const std::string& fqn, int64_t element, int64_t step) {
  float salt = 0.0f;
  for (char c : fqn) salt += static_cast<float>(static_cast<unsigned char>(c) % 7);
  return std::sin(0.7f * static_cast<float>(element + 1) + static_cast<float>(step) + salt);
}

class FakeCluster {
 public:
  FakeCluster(int servers, const std::string& root, uint64_t max_file_bytes = 5'000'000'000,
              std::vector<GroupSpec> specs = Specs())
      : specs_(std::move(specs)) {
    for (int rank = 0; rank < servers; ++rank) {
      registries_.push_back(std::make_unique<Registry>(rank, servers));
      stores_.push_back(std::make_unique<CheckpointStore>(*registries_.back(), rank, servers, root, max_file_bytes));
      EXPECT_TRUE(registries_.back()->ConfigureJob("job", {.num_workers = 1}).ok());
      for (const GroupSpec& spec : specs_) {
        EXPECT_TRUE(registries_.back()->RegisterGroup("job", spec.name, spec.tensors, spec.align, spec.optimizer).ok());
      }
    }
  }
  FakeCluster(int servers, const std::string& root, std::vector<GroupSpec> specs)
      : FakeCluster(servers, root, 5'000'000'000, std::move(specs)) {}

  std::shared_ptr<Group> group(int rank, const std::string& name) { return *registries_[rank]->FindGroup("job", name); }
  CheckpointStore& store(int rank) { return *stores_[rank]; }
  int size() const { return static_cast<int>(registries_.size()); }

  // One step of every group (or of those named in `only`) with a gradient that depends
  // only on (tensor, element, step).
  void Step(int64_t step, const std::set<std::string>& only = {}) {
    for (int rank = 0; rank < size(); ++rank) {
      for (const GroupSpec& spec : specs_) {
        if (!only.empty() && !only.count(spec.name)) continue;
        auto g = group(rank, spec.name);
        const FlatLayout& layout = g->layout();
        std::vector<float> grad(layout.shard_numel(), 0.0f);
        const int64_t start = layout.shard_start(rank);
        for (const TensorPiece& piece : layout.MapRange(start, layout.shard_end(rank))) {
          for (int64_t k = 0; k < piece.numel; ++k) {
            grad[piece.flat_offset - start + k] = Gradient(layout.tensor(piece.tensor_index).fqn,
                                                          piece.intra_start + k, step);
          }
        }
        auto slot = g->BeginScatter(step, 0, DType::kFloat32);
        ASSERT_TRUE(slot.ok()) << slot.status();
        std::memcpy(slot->buffer.data(), grad.data(), slot->buffer.size());
        ASSERT_TRUE(g->CommitScatter(*slot).ok());
      }
    }
  }

  // Every group's values at `version` (or those of the groups named in `only`).
  Values Collect(int64_t version, const std::set<std::string>& only = {}) {
    Values values;
    for (int rank = 0; rank < size(); ++rank) {
      for (const GroupSpec& spec : specs_) {
        if (!only.empty() && !only.count(spec.name)) continue;
        auto g = group(rank, spec.name);
        // A group that is not at `version` fails the test rather than hang it.
        auto snapshot = g->Snapshot(version, absl::Now() + absl::Seconds(10));
        EXPECT_TRUE(snapshot.ok()) << spec.name << ": " << snapshot.status();
        if (!snapshot.ok()) continue;
        const FlatLayout& layout = g->layout();
        const int64_t start = layout.shard_start(rank);
        std::vector<std::pair<std::string, const HostFloats*>> buffers = {{"", &snapshot->params}};
        for (const auto& [state, v] : snapshot->state) buffers.emplace_back("." + state, &v);
        const std::vector<TensorPiece> pieces = layout.MapRange(start, layout.shard_end(rank));
        for (const auto& [suffix, buffer] : buffers) {
          // Padding holds zeros (loads fill it in unwritten buffers).
          std::vector<bool> in_tensor(buffer->size());
          for (const TensorPiece& piece : pieces) {
            std::vector<float>& out = values[layout.tensor(piece.tensor_index).fqn + suffix];
            out.resize(layout.tensor_numel(piece.tensor_index));
            std::copy_n(buffer->begin() + (piece.flat_offset - start), piece.numel, out.begin() + piece.intra_start);
            std::fill_n(in_tensor.begin() + (piece.flat_offset - start), piece.numel, true);
          }
          for (size_t i = 0; i < buffer->size(); ++i) {
            if (!in_tensor[i]) {
              EXPECT_EQ((*buffer)[i], 0.0f) << spec.name << suffix << " padding element " << i;
            }
          }
        }
        values["steps:" + spec.name] = {static_cast<float>(snapshot->optimizer_steps)};
      }
    }
    return values;
  }

  absl::Status Save(const std::string& name, CheckpointKind kind, bool optimizer, int64_t version) {
    std::map<std::string, int64_t> versions;
    for (const GroupSpec& spec : specs_) versions[spec.name] = version;
    return Save(name, kind, optimizer, versions);
  }
  absl::Status Save(const std::string& name, CheckpointKind kind, bool optimizer,
                    const std::map<std::string, int64_t>& versions) {
    for (int rank = 0; rank < size(); ++rank) {
      FLATSHARD_RETURN_IF_ERROR(stores_[rank]->Save(name, kind, optimizer, "job", versions, absl::InfiniteFuture()));
    }
    return stores_[0]->Commit(name);
  }

  absl::Status Load(const std::string& name) { return PrepareAndCommit(name, false).status(); }
  absl::StatusOr<LoadOmissions> LoadNonStrict(const std::string& name) { return PrepareAndCommit(name, true); }

 private:
  // As the client loads: every server prepares, then commits; returns what server 0 says
  // was left out, which every other server must say too.
  absl::StatusOr<LoadOmissions> PrepareAndCommit(const std::string& name, bool non_strict) {
    const uint64_t load_id = ++loads_;  // the same on every server
    LoadOmissions omitted;
    for (int rank = 0; rank < size(); ++rank) {
      PrepareLoadOptions options;
      options.non_strict = non_strict;
      absl::StatusOr<LoadOmissions> prepared = stores_[rank]->PrepareLoad(name, "job", load_id, options);
      if (!prepared.ok()) {
        for (int r = 0; r < size(); ++r) stores_[r]->AbortLoad(load_id);
        return prepared.status();
      }
      if (rank == 0) omitted = *prepared;
      EXPECT_EQ(prepared->missing, omitted.missing) << "server " << rank;
      EXPECT_EQ(prepared->unexpected, omitted.unexpected) << "server " << rank;
    }
    for (int rank = 0; rank < size(); ++rank) FLATSHARD_RETURN_IF_ERROR(stores_[rank]->CommitLoad(name, load_id));
    return omitted;
  }

  const std::vector<GroupSpec> specs_;
  std::vector<std::unique_ptr<Registry>> registries_;
  std::vector<std::unique_ptr<CheckpointStore>> stores_;
  uint64_t loads_ = 0;
};

std::string FreshRoot() {
  const std::string root =
      testing::ScratchPath(absl::StrCat("ckpt-", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  return root;
}

void ExpectBitwiseEqual(const Values& a, const Values& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, values] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    const std::vector<float>& other = b.at(name);
    ASSERT_EQ(values.size(), other.size()) << name;
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(values[i]), std::bit_cast<uint32_t>(other[i])) << name << "[" << i << "]";
    }
  }
}

class ReshardTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ReshardTest, ShardedCheckpointLoadsIntoAnotherServerCountBitwise) {
  const auto [from, to] = GetParam();
  const std::string root = FreshRoot();
  FakeCluster source(from, root);
  for (int step = 0; step < 3; ++step) source.Step(step);
  ASSERT_TRUE(source.Save("ckpt", CheckpointKind::kSharded, /*optimizer=*/true, 3).ok());
  ASSERT_TRUE(std::filesystem::exists(root + "/ckpt/index.json"));
  const Values before = source.Collect(3);

  FakeCluster target(to, root);
  ASSERT_TRUE(target.Load("ckpt").ok());
  ExpectBitwiseEqual(target.Collect(3), before);

  // Training continues to the same result as without the round trip.
  for (int step = 3; step < 5; ++step) {
    source.Step(step);
    target.Step(step);
  }
  ExpectBitwiseEqual(target.Collect(5), source.Collect(5));
}

INSTANTIATE_TEST_SUITE_P(ServerCounts, ReshardTest,
                         ::testing::Values(std::make_pair(3, 2), std::make_pair(2, 5), std::make_pair(1, 4),
                                           std::make_pair(4, 1)));

TEST(CheckpointStoreTest, FullCheckpointIsSafetensorsAndReshards) {
  const std::string root = FreshRoot();
  FakeCluster source(3, root);
  for (int step = 0; step < 2; ++step) source.Step(step);
  ASSERT_TRUE(source.Save("full", CheckpointKind::kFull, true, 2).ok());
  auto header = SafetensorsHeader::Read(root + "/full/model.safetensors");
  ASSERT_TRUE(header.ok()) << header.status();
  ASSERT_NE(header->Find("h.weight"), nullptr);
  EXPECT_EQ(header->Find("h.weight")->dtype, DType::kBFloat16);  // registered dtype
  EXPECT_EQ(header->Find("emb.weight")->shape, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(header->tensors().size(), 4u);  // no padding, no extra tensors
  auto state = SafetensorsHeader::Read(root + "/full/optimizer.safetensors");
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_NE(state->Find("emb.weight.max_exp_avg_sq"), nullptr);
  ASSERT_NE(state->Find("scale.momentum_buffer"), nullptr);
  EXPECT_EQ(state->metadata().at("emb.step"), "2");
  EXPECT_EQ(state->metadata().at("emb.optimizer"), "adamw");
  EXPECT_THAT(state->metadata().at("tiny.hyperparams"), HasSubstr("\"momentum\":0.9"));

  FakeCluster target(2, root);
  ASSERT_TRUE(target.Load("full").ok());
  Values expected = source.Collect(2);
  Values loaded = target.Collect(2);
  // bfloat16-registered tensors come back as the bf16 rounding of the master; the rest bitwise.
  for (float& v : expected["h.weight"]) v = BFloat16BitsToFloat(FloatToBFloat16Bits(v));
  ExpectBitwiseEqual(loaded, expected);
}

// A server writes its pieces of a FULL file in the file's order: where it holds every
// tensor, its writes are one run per file (one extent, under 4 MiB), not a run per
// tensor and state, each of which a load checks and small ones cost a buffered write.
TEST(CheckpointStoreTest, OneServersFullFilesAreEachOneRun) {
  const std::string root = FreshRoot();
  FakeCluster source(1, root);
  source.Step(0);
  ASSERT_TRUE(source.Save("full", CheckpointKind::kFull, true, 1).ok());
  auto text = ReadFileToString(root + "/full/manifest.json");
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json manifest = nlohmann::json::parse(*text);
  ASSERT_EQ(manifest["files"].size(), 2u);
  for (const nlohmann::json& file : manifest["files"]) {
    EXPECT_EQ(file["extents"].size(), 1u) << file["path"] << ": " << file["extents"].dump();
  }
}

TEST(CheckpointStoreTest, LargeFullCheckpointsSplitWithAnIndex) {
  const std::string root = FreshRoot();
  // emb.weight (60 B) alone, emb.bias (28 B) alone, h.weight (18 B, bf16) + scale (8 B).
  FakeCluster source(3, root, /*max_file_bytes=*/40);
  source.Step(0);
  ASSERT_TRUE(source.Save("split", CheckpointKind::kFull, true, 1).ok());
  auto index = ReadFileToString(root + "/split/model.safetensors.index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_THAT(*index, HasSubstr("\"emb.weight\": \"model-00001-of-00003.safetensors\""));
  EXPECT_THAT(*index, HasSubstr("\"total_size\": 114"));  // 15*4 + 7*4 + 9*2 + 2*4
  EXPECT_TRUE(std::filesystem::exists(root + "/split/model-00003-of-00003.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(root + "/split/optimizer.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(root + "/split/model.safetensors"));
  FakeCluster target(2, root);
  ASSERT_TRUE(target.Load("split").ok());
  Values expected = source.Collect(1);
  for (float& v : expected["h.weight"]) v = BFloat16BitsToFloat(FloatToBFloat16Bits(v));
  ExpectBitwiseEqual(target.Collect(1), expected);
}

// A load staged for a job that is then deleted goes with it: its commit finds nothing.
TEST(CheckpointStoreTest, DeletingAJobDropsTheLoadsStagedForIt) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  ASSERT_TRUE(cluster.Save("ckpt", CheckpointKind::kSharded, /*optimizer=*/true, 0).ok());
  ASSERT_TRUE(cluster.store(0).PrepareLoad("ckpt", "job", 1).ok());
  cluster.store(0).DropStagedLoads("other");  // another job's deletion leaves it
  ASSERT_TRUE(cluster.store(0).CommitLoad("ckpt", 1).ok());
  ASSERT_TRUE(cluster.store(0).PrepareLoad("ckpt", "job", 2).ok());
  cluster.store(0).DropStagedLoads("job");
  const absl::Status committed = cluster.store(0).CommitLoad("ckpt", 2);
  EXPECT_EQ(committed.code(), absl::StatusCode::kFailedPrecondition) << committed;
  EXPECT_THAT(std::string(committed.message()),
              HasSubstr("was not prepared for loading here as load 2: its staging was dropped "
                        "(job 'job' was deleted)"));
}

// A load whose client went away (its call cancelled) stops reading and stages nothing:
// no copy of the shards waits for a commit that will not come.
TEST(CheckpointStoreTest, ALoadWhoseClientWentAwayStagesNothing) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  ASSERT_TRUE(cluster.Save("ckpt", CheckpointKind::kSharded, /*optimizer=*/true, 0).ok());
  int asked = 0;
  PrepareLoadOptions gone;
  gone.cancelled = [&asked] { return ++asked > 0; };
  const absl::Status prepared = cluster.store(0).PrepareLoad("ckpt", "job", 1, gone).status();
  EXPECT_TRUE(absl::IsCancelled(prepared)) << prepared;
  EXPECT_GT(asked, 0);
  const absl::Status committed = cluster.store(0).CommitLoad("ckpt", 1);
  EXPECT_EQ(committed.code(), absl::StatusCode::kFailedPrecondition) << committed;
  PrepareLoadOptions present;
  present.cancelled = [] { return false; };
  ASSERT_TRUE(cluster.store(0).PrepareLoad("ckpt", "job", 2, present).ok());
  EXPECT_TRUE(cluster.store(0).CommitLoad("ckpt", 2).ok());
}

TEST(CheckpointStoreTest, LocalCheckpointNeedsTheSameServerCount) {
  const std::string root = FreshRoot();
  FakeCluster source(2, root);
  source.Step(0);
  ASSERT_TRUE(source.Save("local", CheckpointKind::kLocal, true, 1).ok());
  FakeCluster same(2, root);
  ASSERT_TRUE(same.Load("local").ok());
  ExpectBitwiseEqual(same.Collect(1), source.Collect(1));
  FakeCluster other(3, root);
  absl::Status status = other.Load("local");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("LOCAL from 2 servers; this cluster has 3"));
}

TEST(CheckpointStoreTest, DamagedCheckpointsAreRefusedAndStateIsUntouched) {
  const std::string root = FreshRoot();
  FakeCluster source(2, root);
  source.Step(0);
  ASSERT_TRUE(source.Save("good", CheckpointKind::kSharded, true, 1).ok());
  std::filesystem::copy(root + "/good", root + "/flipped", std::filesystem::copy_options::recursive);
  std::filesystem::copy(root + "/good", root + "/short", std::filesystem::copy_options::recursive);
  {
    std::fstream file(root + "/flipped/shard-1.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-3, std::ios::end);
    file.put('\x5a');
  }
  std::filesystem::resize_file(root + "/short/shard-0.safetensors",
                               std::filesystem::file_size(root + "/short/shard-0.safetensors") - 10);

  FakeCluster target(2, root);
  target.Step(0);
  const Values before = target.Collect(1);
  absl::Status flipped = target.Load("flipped");
  EXPECT_EQ(flipped.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(flipped.message()), HasSubstr("shard-1.safetensors' is corrupted"));
  absl::Status truncated = target.Load("short");
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(truncated.message()), HasSubstr("shard-0.safetensors"));
  ExpectBitwiseEqual(target.Collect(1), before);
  EXPECT_EQ(target.Load("missing").code(), absl::StatusCode::kNotFound);
}

// A manifest that is valid JSON of the wrong shape (a field of another type or missing,
// an array for an object) is refused like any damage, naming the manifest, and leaves
// the groups untouched; listing the root skips it rather than failing.
TEST(CheckpointStoreTest, ManifestsOfTheWrongShapeAreRefusedAndListingSkipsThem) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  cluster.Step(0);
  ASSERT_TRUE(cluster.Save("good", CheckpointKind::kSharded, true, 1).ok());
  std::ifstream in(root + "/good/manifest.json");
  const nlohmann::json good = nlohmann::json::parse(in);
  const std::vector<std::pair<std::string, nlohmann::json>> damage = {
      {"", nlohmann::json::array()},        {"/kind", 5},
      {"/optimizer", "yes"},                {"/groups", nlohmann::json::object({{"a", 1}})},
      {"/groups", 3},                       {"/groups/0", 7},
      {"/groups/0/name", 2},                {"/groups/0/state", {1, 2}},
      {"/groups/0/version", "x"},           {"/groups/0/align", nullptr},
      {"/files", "x"},                      {"/files/0", "x"},
      {"/files/0/path", 9},                 {"/files/0/bytes", -1},
      {"/files/0/extents", {{1}}},          {"/format", 1},
      {"/root", 0},
      // Numbers of the right type but not a count: nlohmann would convert them (0.5 to 0,
      // 1e30 by a conversion C++ leaves undefined) and a group would load at them.
      {"/groups/0/version", -1},            {"/groups/0/version", 0.5},
      {"/groups/0/optimizer_steps", 1e30},  {"/groups/0/optimizer_steps", -3},
      {"/groups/0/align", 2.5},             {"/files/0/bytes", 1e300},
      {"/servers", -2},
  };
  std::vector<std::string> removed = {"/groups", "/files", "/groups/0/tensors", "/groups/0/name", "/kind"};
  const Values before = cluster.Collect(1);
  int index = 0;
  auto expect_refused = [&](const nlohmann::json& manifest, const std::string& what) {
    const std::string name = absl::StrCat("bad-", index++);
    std::filesystem::copy(root + "/good", root + "/" + name, std::filesystem::copy_options::recursive);
    std::ofstream(root + "/" + name + "/manifest.json", std::ios::trunc) << manifest.dump();
    const absl::Status loaded = cluster.Load(name);
    EXPECT_TRUE(absl::IsDataLoss(loaded) || absl::IsFailedPrecondition(loaded)) << what << ": " << loaded;
    EXPECT_THAT(std::string(loaded.message()), HasSubstr(name)) << what;
  };
  for (const auto& [pointer, value] : damage) {
    nlohmann::json manifest = good;
    manifest[nlohmann::json::json_pointer(pointer)] = value;
    expect_refused(manifest, absl::StrCat(pointer, " = ", value.dump()));
  }
  for (const std::string& pointer : removed) {
    nlohmann::json manifest = good;
    const nlohmann::json::json_pointer path(pointer);
    manifest[path.parent_pointer()].erase(path.back());
    expect_refused(manifest, absl::StrCat("without ", pointer));
  }
  // Numbers no double holds are malformed JSON (nlohmann throws out_of_range for them, not
  // parse_error), for the load and for the listing.
  for (const char* number : {"1e999", "-2E400"}) {
    const std::string name = absl::StrCat("bad-", index++);
    std::filesystem::copy(root + "/good", root + "/" + name, std::filesystem::copy_options::recursive);
    nlohmann::json manifest = good;
    manifest["/groups/0/version"_json_pointer] = "@number@";
    std::string text = manifest.dump();
    text.replace(text.find("\"@number@\""), 10, number);
    std::ofstream(root + "/" + name + "/manifest.json", std::ios::trunc) << text;
    const absl::Status loaded = cluster.Load(name);
    EXPECT_TRUE(absl::IsDataLoss(loaded)) << number << ": " << loaded;
    EXPECT_THAT(std::string(loaded.message()), HasSubstr(name)) << number;
  }
  ExpectBitwiseEqual(cluster.Collect(1), before);
  auto list = cluster.store(0).List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(std::any_of(list->begin(), list->end(), [](const CheckpointInfo& info) {
    return info.name == "good" && info.complete;
  }));
  ASSERT_TRUE(cluster.Load("good").ok());
}

// A peer's part (WriteCheckpointPart) must list plain file names and name the save it
// was sent for; a part description on disk of the wrong shape makes the commit DataLoss,
// not an exception.
TEST(CheckpointStoreTest, PartDescriptionsOfTheWrongShapeAreRefused) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  EXPECT_TRUE(absl::IsInvalidArgument(cluster.store(0).OpenPart("peer", "../up").status()));
  auto sink = cluster.store(0).OpenPart("peer", "p");
  ASSERT_TRUE(sink.ok()) << sink.status();
  for (const auto& [part, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"files": [5]})", "lists a file that is not a name: 5"},
           {R"({"files": ["../x"]})", "checkpoint file '../x'"},
           {R"({"files": "x"})", "not a JSON object with its files"},
           {R"({"files": [], "save_id": "q"})", R"(part names save "q", not save 'p')"}}) {
    const absl::Status finished = cluster.store(0).FinishPart("peer", "p", 1, **sink, part, /*async=*/true);
    EXPECT_EQ(finished.code(), absl::StatusCode::kInvalidArgument) << part << ": " << finished;
    EXPECT_THAT(std::string(finished.message()), HasSubstr(message));
  }
  std::map<std::string, int64_t> versions = {{"emb", 0}, {"tiny", 0}, {"half", 0}};
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(cluster.store(rank).Save("torn", CheckpointKind::kSharded, false, "job", versions,
                                         absl::InfiniteFuture()).ok());
  }
  for (const char* part : {R"([1, 2])", R"({"files": [5], "extents": {}})", R"({"files": [], "kind": 7})",
                           R"({"files": [], "servers": 1e999})"}) {
    std::ofstream(root + "/.torn.partial/unnamed/part-1.json", std::ios::trunc) << part;
    const absl::Status committed = cluster.store(0).Commit("torn");
    EXPECT_TRUE(absl::IsDataLoss(committed) || absl::IsFailedPrecondition(committed)) << part << ": " << committed;
    EXPECT_THAT(std::string(committed.message()), HasSubstr("torn"));
  }
}

// Server 0's part holds the group specs, the others only their digest. A commit refuses
// parts whose specs disagree (servers that saved other versions) or whose specs do not
// match their digest (damage), and leaves no part in the checkpoint it commits.
TEST(CheckpointStoreTest, PartsAgreeOnTheirGroupSpecsByDigestAndGoAtCommit) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  const std::map<std::string, int64_t> at0 = {{"emb", 0}, {"tiny", 0}, {"half", 0}};
  const std::map<std::string, int64_t> at1 = {{"emb", 1}, {"tiny", 1}, {"half", 1}};
  auto part = [&](const std::string& name, int rank) {
    const std::string path = absl::StrCat(root, "/.", name, ".partial/unnamed/part-", rank, ".json");
    return nlohmann::json::parse(*ReadFileToString(path));
  };
  ASSERT_TRUE(cluster.store(0).Save("x", CheckpointKind::kSharded, true, "job", at0, absl::InfiniteFuture()).ok());
  cluster.Step(0);
  ASSERT_TRUE(cluster.store(1).Save("x", CheckpointKind::kSharded, true, "job", at1, absl::InfiniteFuture()).ok());
  EXPECT_EQ(part("x", 0).at("groups").size(), 3u);
  EXPECT_FALSE(part("x", 1).contains("groups"));
  const absl::Status mixed = cluster.store(0).Commit("x");
  EXPECT_TRUE(absl::IsFailedPrecondition(mixed)) << mixed;
  EXPECT_THAT(std::string(mixed.message()), HasSubstr("server 1's part disagrees with server 0's"));

  for (const char* name : {"damaged", "whole"}) {
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_TRUE(
          cluster.store(rank).Save(name, CheckpointKind::kSharded, true, "job", at1, absl::InfiniteFuture()).ok());
    }
  }
  nlohmann::json damaged = part("damaged", 0);
  damaged["groups"][0]["version"] = 0;
  std::ofstream(root + "/.damaged.partial/unnamed/part-0.json", std::ios::trunc) << damaged.dump();
  const absl::Status refused = cluster.store(0).Commit("damaged");
  EXPECT_TRUE(absl::IsDataLoss(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("server 0's part holds group specs that do not match its digest"));

  ASSERT_TRUE(cluster.store(0).Commit("whole").ok());
  for (const auto& entry : std::filesystem::directory_iterator(root + "/whole")) {
    const std::string file = entry.path().filename().string();
    EXPECT_TRUE(file == "manifest.json" || file == "index.json" || absl::StartsWith(file, "shard-")) << file;
  }
  const nlohmann::json manifest = nlohmann::json::parse(*ReadFileToString(root + "/whole/manifest.json"));
  EXPECT_EQ(manifest.at("groups").size(), 3u);
  EXPECT_FALSE(manifest.contains("groups_xxh3"));
  FakeCluster target(3, root);
  ASSERT_TRUE(target.Load("whole").ok());
  ExpectBitwiseEqual(target.Collect(1), cluster.Collect(1));
}

TEST(CheckpointStoreTest, MismatchedLayoutIsRefusedNamingTheGroup) {
  const std::string root = FreshRoot();
  FakeCluster source(1, root);
  ASSERT_TRUE(source.Save("ckpt", CheckpointKind::kSharded, true, 0).ok());
  Registry other(0, 1);
  ASSERT_TRUE(other.ConfigureJob("job", {.num_workers = 1}).ok());
  for (const GroupSpec& spec : Specs()) {
    std::vector<TensorSpec> tensors = spec.tensors;
    if (spec.name == "tiny") tensors[0].shape = {3};
    ASSERT_TRUE(other.RegisterGroup("job", spec.name, tensors, spec.align, spec.optimizer).ok());
  }
  CheckpointStore store(other, 0, 1, root);
  absl::Status status = store.PrepareLoad("ckpt", "job", 1).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("checkpoint 'ckpt' group 'tiny' holds tensor {\"dtype\":\"float32\",\"name\":\"scale\","
                        "\"shape\":[2]}; group 'tiny' of job 'job' registers it as {\"dtype\":\"float32\","
                        "\"name\":\"scale\",\"shape\":[3]}"));
}

// Specs() wrapped otherwise: emb's weight in a group of its own (no alignment), its bias
// left in 'emb'; the same optimizers per tensor.
std::vector<GroupSpec> RegroupedSpecs() {
  std::vector<GroupSpec> specs = Specs();
  GroupSpec weight = specs[0];
  weight.name = "w";
  weight.tensors = {specs[0].tensors[0]};
  weight.align = 0;
  specs[0].tensors = {specs[0].tensors[1]};
  specs.insert(specs.begin(), weight);
  return specs;
}

// Values of the tensors (and their optimizer state), without the per-group step counts.
Values TensorValues(Values values) {
  std::erase_if(values, [](const auto& entry) { return absl::StartsWith(entry.first, "steps:"); });
  return values;
}

class RegroupTest : public ::testing::TestWithParam<CheckpointKind> {};

TEST_P(RegroupTest, LoadsIntoOtherGroupsByTensorBitwise) {
  const CheckpointKind kind = GetParam();
  const std::string root = FreshRoot();
  FakeCluster source(3, root);
  for (int step = 0; step < 2; ++step) source.Step(step);
  ASSERT_TRUE(source.Save("ckpt", kind, /*optimizer=*/true, 2).ok());
  FakeCluster target(2, root, RegroupedSpecs());
  const absl::Status load = target.Load("ckpt");
  ASSERT_TRUE(load.ok()) << load;
  Values expected = TensorValues(source.Collect(2));
  if (kind == CheckpointKind::kFull) {  // stored in its registered dtype
    for (float& v : expected["h.weight"]) v = BFloat16BitsToFloat(FloatToBFloat16Bits(v));
  }
  const Values loaded = target.Collect(2);
  ExpectBitwiseEqual(TensorValues(loaded), expected);
  EXPECT_EQ(loaded.at("steps:w"), std::vector<float>{2.0f});  // emb's count, in both of its parts
  EXPECT_EQ(loaded.at("steps:emb"), std::vector<float>{2.0f});
  if (kind == CheckpointKind::kSharded) {  // every bit kept: training goes on as without the round trip
    for (int step = 2; step < 4; ++step) {
      source.Step(step);
      target.Step(step);
    }
    ExpectBitwiseEqual(TensorValues(target.Collect(4)), TensorValues(source.Collect(4)));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, RegroupTest, ::testing::Values(CheckpointKind::kFull, CheckpointKind::kSharded),
                         [](const auto& info) { return std::string(CheckpointKindName(info.param)); });

// The entries of `values` for the tensors in `names` (their optimizer state included)
// and for the "steps:<group>" keys in `names`.
Values Only(const Values& values, const std::set<std::string>& names) {
  Values picked;
  for (const auto& [key, elements] : values) {
    absl::string_view tensor = key;
    for (absl::string_view state : {".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq", ".momentum_buffer"}) {
      if (absl::ConsumeSuffix(&tensor, state)) break;
    }
    if (names.count(std::string(tensor))) picked[key] = elements;
  }
  return picked;
}

class NonStrictLoadTest : public ::testing::TestWithParam<CheckpointKind> {};

// A non-strict load (torch's strict=False: fine-tuning from a checkpoint of another model)
// takes what the checkpoint holds of each group, keeps the rest with its optimizer
// state, moves a trained group it holds nothing of only to the loaded trained groups'
// version (a frozen one not at all; a frozen group loaded at its own version does not
// count), and says what it left out.
TEST_P(NonStrictLoadTest, LoadsWhatItHoldsAndKeepsTheRest) {
  const CheckpointKind kind = GetParam();
  const std::string root = FreshRoot();
  const int servers = kind == CheckpointKind::kLocal ? 3 : 2;
  std::vector<GroupSpec> specs = Specs();
  const GroupSpec lookup{"lookup", {{"lut", {2}, DType::kFloat32}}, 0, Frozen{}};  // saved at version 0
  specs.push_back(lookup);
  FakeCluster source(3, root, specs);
  const std::set<std::string> saved_trained = {"emb", "tiny", "half"};
  for (int step = 0; step < 2; ++step) source.Step(step, saved_trained);
  ASSERT_TRUE(
      source.Save("ckpt", kind, /*optimizer=*/true, {{"emb", 2}, {"tiny", 2}, {"half", 2}, {"lookup", 0}}).ok());
  GroupSpec emb = specs[0];  // loses its bias, gains a head (a LOCAL load needs emb as saved)
  if (kind != CheckpointKind::kLocal) emb.tensors = {emb.tensors[0], {"emb.head", {3, 3}, DType::kFloat32}};
  const GroupSpec fresh{"new", {{"head.weight", {4}, DType::kFloat32}}, 0,
                       kernels::SgdHyperparams{.lr = 0.5f, .momentum = 0.9f}};
  const GroupSpec fixed{"fixed", {{"table", {3}, DType::kFloat32}}, 0, Frozen{}};
  FakeCluster target(servers, root, {emb, specs[1], fresh, fixed, lookup});  // no "half"
  const std::set<std::string> trained = {"emb", "tiny", "new"};
  for (int step = 0; step < 3; ++step) target.Step(step, trained);
  const Values before = target.Collect(3, trained);
  const Values frozen = target.Collect(0, {"fixed"});

  const absl::StatusOr<LoadOmissions> omitted = target.LoadNonStrict("ckpt");
  ASSERT_TRUE(omitted.ok()) << omitted.status();
  if (kind == CheckpointKind::kLocal) {
    EXPECT_EQ(omitted->missing, std::vector<std::string>({"table", "head.weight"}));  // the registry's order
    EXPECT_EQ(omitted->unexpected, std::vector<std::string>({"h.weight"}));
  } else {
    EXPECT_EQ(omitted->missing, std::vector<std::string>({"emb.head", "table", "head.weight"}));
    EXPECT_EQ(omitted->unexpected, std::vector<std::string>({"emb.bias", "h.weight"}));
  }
  const Values saved = source.Collect(2, saved_trained);
  const Values loaded = target.Collect(2, {"emb", "tiny"});
  const std::set<std::string> from_checkpoint = kind == CheckpointKind::kLocal
                                                    ? std::set<std::string>{"emb.weight", "emb.bias", "scale"}
                                                    : std::set<std::string>{"emb.weight", "scale"};
  ExpectBitwiseEqual(Only(loaded, from_checkpoint), Only(saved, from_checkpoint));
  if (kind != CheckpointKind::kLocal) {  // kept, values and optimizer state, in the loaded group
    ExpectBitwiseEqual(Only(loaded, {"emb.head"}), Only(before, {"emb.head"}));
  }
  EXPECT_EQ(loaded.at("steps:emb"), std::vector<float>{2.0f});  // the saved count
  EXPECT_EQ(loaded.at("steps:tiny"), std::vector<float>{2.0f});
  // Nothing of "new" saved: its values, state and step count as they were, at the loaded
  // version; the frozen group as it was, at its own.
  ExpectBitwiseEqual(target.Collect(2, {"new"}), Only(before, {"head.weight", "steps:new"}));
  ExpectBitwiseEqual(target.Collect(0, {"fixed"}), frozen);

  // Training goes on from the loaded state: emb.weight as the source's own step 2 makes it.
  source.Step(2, saved_trained);
  target.Step(2, trained);
  ExpectBitwiseEqual(Only(target.Collect(3, trained), from_checkpoint),
                     Only(source.Collect(3, saved_trained), from_checkpoint));
}

INSTANTIATE_TEST_SUITE_P(Kinds, NonStrictLoadTest,
                         ::testing::Values(CheckpointKind::kFull, CheckpointKind::kSharded, CheckpointKind::kLocal),
                         [](const auto& info) { return std::string(CheckpointKindName(info.param)); });

// Linear probing (a checkpoint of frozen weights only): no trained group loads, so the
// trained group the checkpoint holds nothing of keeps its version too, and is installed
// like every trained group of a load (its steps in progress start over).
TEST(CheckpointStoreTest, ANonStrictLoadOfNoTrainedGroupKeepsTheirVersions) {
  const std::string root = FreshRoot();
  const GroupSpec lookup{"lookup", {{"lut", {5}, DType::kFloat32}}, 0, Frozen{}};
  const GroupSpec fresh{"new", {{"head.weight", {4}, DType::kFloat32}}, 0,
                       kernels::SgdHyperparams{.lr = 0.5f, .momentum = 0.9f}};
  FakeCluster source(1, root, {lookup});
  ASSERT_TRUE(source.Save("frozen", CheckpointKind::kFull, false, 0).ok());
  FakeCluster target(2, root, {lookup, fresh});
  for (int step = 0; step < 3; ++step) target.Step(step, {"new"});
  const Values before = target.Collect(3, {"new"});

  const absl::StatusOr<LoadOmissions> omitted = target.LoadNonStrict("frozen");
  ASSERT_TRUE(omitted.ok()) << omitted.status();
  EXPECT_EQ(omitted->missing, std::vector<std::string>{"head.weight"});
  EXPECT_TRUE(omitted->unexpected.empty());
  ASSERT_EQ(target.group(0, "new")->version(), 3);
  ExpectBitwiseEqual(target.Collect(3, {"new"}), before);  // its version, values, state and step count
  for (int rank = 0; rank < target.size(); ++rank) EXPECT_NE(target.group(rank, "new")->stats().load_id, 0u);
  target.Step(3, {"new"});
  EXPECT_EQ(target.group(0, "new")->version(), 4);
}

// A tensor of another shape or dtype is refused by a non-strict load as by a strict one,
// the groups untouched.
TEST(CheckpointStoreTest, NonStrictLoadsStillRefuseAnotherShapeOrDtype) {
  const std::string root = FreshRoot();
  {
    FakeCluster source(1, root);
    source.Step(0);
    ASSERT_TRUE(source.Save("ckpt", CheckpointKind::kFull, true, 1).ok());
  }
  const std::vector<GroupSpec> specs = Specs();
  GroupSpec transposed = specs[0];
  transposed.tensors[0].shape = {3, 5};
  GroupSpec widened = specs[2];
  widened.tensors[0].dtype = DType::kFloat32;
  for (const std::vector<GroupSpec>& groups : {std::vector<GroupSpec>{transposed}, std::vector<GroupSpec>{widened}}) {
    FakeCluster target(1, root, groups);
    target.Step(0);
    const Values before = target.Collect(1);
    const absl::Status status = target.LoadNonStrict("ckpt").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("registers it as"));
    ExpectBitwiseEqual(target.Collect(1), before);
  }
}

// Loads into groups that cannot take the checkpoint's tensors are refused, saying why,
// before anything is installed.
TEST(CheckpointStoreTest, LoadsIntoOtherGroupsRefuseWhatTheyCannotPlace) {
  const std::string root = FreshRoot();
  {
    FakeCluster source(1, root);
    source.Step(0);
    ASSERT_TRUE(source.Save("ckpt", CheckpointKind::kSharded, true, 1).ok());
    ASSERT_TRUE(source.Save("local", CheckpointKind::kLocal, true, 1).ok());
    source.Step(1, {"emb"});  // emb at version 2, half at 1
    ASSERT_TRUE(source.Save("apart", CheckpointKind::kSharded, false, {{"emb", 2}, {"tiny", 1}, {"half", 1}}).ok());
  }
  const std::vector<GroupSpec> specs = Specs();
  const GroupSpec& emb = specs[0];
  const GroupSpec& tiny = specs[1];
  const GroupSpec& half = specs[2];
  const TensorSpec extra{"emb.extra", {2}, DType::kFloat32};
  struct Case {
    std::string checkpoint;
    std::vector<GroupSpec> groups;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"ckpt",
       {{"emb", {emb.tensors[0], emb.tensors[1], extra}, 4, emb.optimizer}, tiny, half},
       "tensor 'emb.extra' of group 'emb' of job 'job' is not in checkpoint 'ckpt'"},
      {"ckpt",
       {{"emb", {emb.tensors[0]}, 4, emb.optimizer}, tiny, half},
       "checkpoint 'ckpt' has tensor 'emb.bias' (group 'emb'), which no group of job 'job' registers"},
      {"ckpt",
       {{"emb", {emb.tensors[0]}, 4, emb.optimizer}, tiny, {"mixed", {emb.tensors[1], half.tensors[0]}, 0, emb.optimizer}},
       "checkpoint 'ckpt' group 'half' has adam optimizer state; group 'mixed' uses adamw"},
      {"apart",
       {{"emb", {emb.tensors[0]}, 4, emb.optimizer}, tiny, {"mixed", {emb.tensors[1], half.tensors[0]}, 0, emb.optimizer}},
       "group 'mixed' would load tensors of checkpoint 'apart' groups 'emb' (version 2, 0 optimizer steps) and "
       "'half' (version 1, 0 optimizer steps): a group loads from groups saved at one step"},
      {"ckpt",
       {emb, half, {"a", tiny.tensors, 0, tiny.optimizer}, {"b", tiny.tensors, 0, tiny.optimizer}},
       "tensor 'scale' of checkpoint 'ckpt' group 'tiny' would load into groups 'a' and 'b' of job 'job'"},
      {"local",
       {emb, tiny, half, {"w", {extra}, 0, emb.optimizer}},
       "checkpoint 'local' is LOCAL and has no group 'w' (save FULL or SHARDED to load into other groups)"},
      {"local", RegroupedSpecs(), "checkpoint 'local' is LOCAL and its group 'emb' ([{"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    FakeCluster target(1, root, c.groups);
    target.Step(0);
    const Values before = target.Collect(1);
    const absl::Status status = target.Load(c.checkpoint);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
    ExpectBitwiseEqual(target.Collect(1), before);
  }
}

// A tensor that two of the checkpoint's groups hold under one name loads into a group of
// either's name; into any other group, which one it would take is ambiguous.
TEST(CheckpointStoreTest, ATensorNameInTwoCheckpointGroupsLoadsOnlyByGroupName) {
  const std::string root = FreshRoot();
  const std::vector<GroupSpec> specs = Specs();
  const std::vector<GroupSpec> twins = {{"a", specs[1].tensors, 0, specs[1].optimizer},
                                        {"b", specs[1].tensors, 0, specs[1].optimizer}};
  FakeCluster source(2, root, twins);
  source.Step(0, {"a"});
  source.Step(0, {"b"});
  ASSERT_TRUE(source.Save("twins", CheckpointKind::kSharded, true, 1).ok());
  FakeCluster same(3, root, twins);
  ASSERT_TRUE(same.Load("twins").ok());
  ExpectBitwiseEqual(same.Collect(1), source.Collect(1));
  FakeCluster other(1, root, {twins[0], {"c", specs[1].tensors, 0, specs[1].optimizer}});
  const absl::Status status = other.Load("twins");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("checkpoint 'twins' holds tensor 'scale' in groups 'a' and 'b', none of them group 'c' of "
                        "job 'job': which one it takes is ambiguous"));
}

TEST(CheckpointStoreTest, NamesAreConfinedAndPartialCheckpointsAreNotComplete) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  for (const std::string bad : {"../escape", "/abs", ".hidden", "a/b", ""}) {
    EXPECT_EQ(cluster.store(0).Save(bad, CheckpointKind::kFull, false, "job", {}, absl::InfiniteFuture()).code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  std::filesystem::create_directory_symlink("/tmp", root + "/link");
  EXPECT_EQ(cluster.Load("link").code(), absl::StatusCode::kFailedPrecondition);
  // A link to itself: stat() fails with ELOOP, which std::filesystem throws unless asked not to.
  std::filesystem::create_directory_symlink(root + "/loop", root + "/loop");
  const absl::Status loop = cluster.Load("loop");
  EXPECT_TRUE(absl::IsFailedPrecondition(loop) || absl::IsNotFound(loop)) << loop;
  EXPECT_EQ(cluster.store(0).Save("loop", CheckpointKind::kFull, false, "job", {}, absl::InfiniteFuture()).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(cluster.store(0).List().ok());

  // Only server 0 saved: the commit refuses, the checkpoint is listed as incomplete.
  std::map<std::string, int64_t> versions = {{"emb", 0}, {"tiny", 0}, {"half", 0}};
  ASSERT_TRUE(cluster.store(0).Save("half-done", CheckpointKind::kSharded, false, "job", versions,
                                    absl::InfiniteFuture()).ok());
  absl::Status commit = cluster.store(0).Commit("half-done");
  EXPECT_THAT(std::string(commit.message()), HasSubstr("server 1 has not saved its part"));
  ASSERT_TRUE(cluster.Save("done", CheckpointKind::kSharded, false, 0).ok());
  auto list = cluster.store(1).List();
  ASSERT_TRUE(list.ok());
  std::map<std::string, bool> complete;
  for (const CheckpointInfo& info : *list) complete[info.name] = info.complete;
  EXPECT_EQ(complete.at("done"), true);
  EXPECT_EQ(complete.at("half-done"), false);
  EXPECT_EQ(cluster.Save("done", CheckpointKind::kSharded, false, 0).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(cluster.store(0).Delete("done").ok());
  ASSERT_TRUE(cluster.store(0).Delete("half-done").ok());
  EXPECT_EQ(cluster.store(0).Delete("done").code(), absl::StatusCode::kNotFound);
}

// Every part is written, but there is no room for what the commit writes (a SHARDED
// checkpoint's index.json, the manifest; a file size limit of 64 bytes stands in for a
// full disk): the commit fails saying so, and the save's files go, since nothing can
// commit them any more.
TEST(CheckpointStoreTest, ACommitWithoutRoomRemovesTheSave) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  const std::map<std::string, int64_t> versions = {{"emb", 0}, {"tiny", 0}, {"half", 0}};
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(
        cluster.store(rank).Save("x", CheckpointKind::kSharded, false, "job", versions, absl::InfiniteFuture()).ok());
  }
  absl::Status committed;
  {
    const testing::ScopedFileSizeLimit limit(64);
    const FileSizeLimitAsError as_error;
    committed = cluster.store(0).Commit("x");
  }
  EXPECT_TRUE(absl::IsResourceExhausted(committed)) << committed;
  EXPECT_THAT(std::string(committed.message()), HasSubstr("File too large"));
  EXPECT_FALSE(std::filesystem::exists(root + "/.x.partial"));
  EXPECT_FALSE(std::filesystem::exists(root + "/x"));
}

// A part streamed to server 0 that fails leaves a marker; only when the other part is in
// too does the save go. A rank outside the cluster (a peer's bad request) marks nothing.
TEST(CheckpointStoreTest, AnAbandonedPartRemovesTheSaveOnceTheOtherPartIsIn) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  auto sink = cluster.store(0).OpenPart("x", "s");
  ASSERT_TRUE(sink.ok()) << sink.status();
  const std::string dir = root + "/.x.partial/s";
  for (const int rank : {-1, 2}) {
    cluster.store(0).AbandonPart("x", "s", rank, 2, false, absl::CancelledError("gone"));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  cluster.store(0).AbandonPart("x", "s", 1, 2, false, absl::CancelledError("gone"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/failed-1.json"));  // server 0 still writes its part
  const std::string part = R"({"files": [], "save_id": "s", "servers": 2})";
  ASSERT_TRUE(cluster.store(0).FinishPart("x", "s", 0, **sink, part, /*async=*/false).ok());
  EXPECT_FALSE(std::filesystem::exists(root + "/.x.partial"));
}

// Waits until `store` runs no save or load (an async save is done and committed, or
// failed).
void WaitIdle(CheckpointStore& store) {
  for (int i = 0; i < 500 && !store.Progress().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(store.Progress().empty()) << "a save ran on for 5 s";
}

std::map<std::string, bool> Listing(CheckpointStore& store) {
  std::map<std::string, bool> complete;
  auto list = store.List();
  EXPECT_TRUE(list.ok()) << list.status();
  if (list.ok()) {
    for (const CheckpointInfo& info : *list) complete[info.name] = info.complete;
  }
  return complete;
}

SaveOptions Options(bool async, const std::string& save_id) {
  SaveOptions options;
  options.async = async;
  options.save_id = save_id;
  return options;
}

// A save that failed half-way leaves server 1's FULL part in its directory. A later
// async SHARDED save of the same name must neither commit with that part nor wedge
// behind it: server 0 waits for server 1's part of its own save, which commits.
TEST(CheckpointStoreTest, AnEarlierSavesLeftoversNeverJoinALaterSave) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  const std::map<std::string, int64_t> versions = {{"emb", 0}, {"tiny", 0}, {"half", 0}};
  const Values saved = cluster.Collect(0);
  ASSERT_TRUE(cluster.store(1).Save("x", CheckpointKind::kFull, true, "job", versions, absl::InfiniteFuture(),
                                    Options(false, "old")).ok());
  ASSERT_TRUE(std::filesystem::exists(root + "/.x.partial/old/model.safetensors"));
  // Committing the old save's parts as the new one is refused, naming why.
  const absl::Status mixed = cluster.store(1).Commit("x", "new");
  EXPECT_THAT(std::string(mixed.message()), HasSubstr("server 0 has not saved its part"));

  ASSERT_TRUE(cluster.store(0).Save("x", CheckpointKind::kSharded, false, "job", versions, absl::InfiniteFuture(),
                                    Options(true, "new")).ok());
  WaitIdle(cluster.store(0));
  EXPECT_EQ(Listing(cluster.store(0)).at("x"), false);  // server 1's part of "new" is not in
  const absl::Status stale = cluster.store(0).Commit("x", "new");
  EXPECT_TRUE(absl::IsFailedPrecondition(stale)) << stale;
  EXPECT_THAT(std::string(stale.message()), HasSubstr("server 1 has not saved its part"));

  ASSERT_TRUE(cluster.store(1).Save("x", CheckpointKind::kSharded, false, "job", versions, absl::InfiniteFuture(),
                                    Options(true, "new")).ok());
  WaitIdle(cluster.store(1));
  EXPECT_EQ(Listing(cluster.store(0)), (std::map<std::string, bool>{{"x", true}}));
  // What only the old save wrote is not part of the new checkpoint, and is gone.
  EXPECT_FALSE(std::filesystem::exists(root + "/x/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(root + "/x/optimizer.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(root + "/.x.partial"));
  cluster.Step(0);  // the groups move on; the load takes them back to version 0
  ASSERT_NE(cluster.Collect(1), saved);
  ASSERT_TRUE(cluster.Load("x").ok());
  const Values loaded = cluster.Collect(0);
  for (const GroupSpec& spec : Specs()) {
    for (const TensorSpec& tensor : spec.tensors) {
      EXPECT_EQ(loaded.at(tensor.fqn), saved.at(tensor.fqn)) << tensor.fqn;
    }
  }
}

// Every part of save "a" is written and its commit has not begun when another save of
// the name starts on server 1, from a later version (a second caller that found no
// server writing). It must not touch save "a"'s files: "a" commits what it saved, and
// "b" then learns that the name was taken.
TEST(CheckpointStoreTest, ASaveStartedBeforeAnotherCommitsNeverTouchesItsFiles) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  const Values saved = cluster.Collect(0);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(cluster.store(rank)
                    .Save("x", CheckpointKind::kFull, true, "job", {{"emb", 0}, {"tiny", 0}, {"half", 0}},
                          absl::InfiniteFuture(), Options(false, "a"))
                    .ok());
  }
  cluster.Step(0);
  ASSERT_NE(cluster.Collect(1), saved);
  ASSERT_TRUE(cluster.store(1)
                  .Save("x", CheckpointKind::kFull, true, "job", {{"emb", 1}, {"tiny", 1}, {"half", 1}},
                        absl::InfiniteFuture(), Options(false, "b"))
                  .ok());
  const absl::Status committed = cluster.store(0).Commit("x", "a");
  ASSERT_TRUE(committed.ok()) << committed;
  const absl::Status late = cluster.store(0).Commit("x", "b");
  EXPECT_TRUE(absl::IsAlreadyExists(late)) << late;
  EXPECT_THAT(std::string(late.message()), HasSubstr("committed by another save"));
  EXPECT_TRUE(cluster.store(0).Commit("x", "a").ok());  // a retried commit of "a" is done
  EXPECT_EQ(Listing(cluster.store(1)), (std::map<std::string, bool>{{"x", true}}));
  EXPECT_FALSE(std::filesystem::exists(root + "/.x.partial"));
  ASSERT_TRUE(cluster.Load("x").ok());
  const Values loaded = cluster.Collect(0);
  for (const GroupSpec& spec : Specs()) {
    for (const TensorSpec& tensor : spec.tensors) {
      EXPECT_EQ(loaded.at(tensor.fqn), saved.at(tensor.fqn)) << tensor.fqn;
    }
  }
}

// Training moves past a save's cut before the server pins it: the pin is refused as
// Aborted (naming the group) and holds nothing, so training goes on; pinned at a later
// cut, the save writes exactly that cut.
TEST(CheckpointStoreTest, ASaveOvertakenByTrainingPinsALaterCut) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  CheckpointStore& store = cluster.store(0);
  auto save = store.BeginSave("x", CheckpointKind::kSharded, true, "job", Options(false, "s"));
  ASSERT_TRUE(save.ok()) << save.status();
  cluster.Step(0);
  const absl::Status overtaken = store.PinSave(**save, {{"emb", 0}, {"tiny", 0}, {"half", 0}}, absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsAborted(overtaken)) << overtaken;
  EXPECT_THAT(std::string(overtaken.message()), HasSubstr("is at version 1, past the cut's 0"));
  EXPECT_EQ(store.JobVersions("job"), (std::map<std::string, int64_t>{{"emb", 1}, {"half", 1}, {"tiny", 1}}));
  cluster.Step(1);  // nothing is pinned: the step is not held
  ASSERT_TRUE(store.PinSave(**save, store.JobVersions("job"), absl::InfiniteFuture()).ok());
  const Values saved = cluster.Collect(2);
  ASSERT_TRUE(store.FinishSave(**save, absl::InfiniteFuture()).ok());
  ASSERT_TRUE(store.Commit("x", "s").ok());
  cluster.Step(2);
  ASSERT_TRUE(cluster.Load("x").ok());
  EXPECT_EQ(cluster.Collect(2), saved);
}

// A blocking save's part is written, but not yet committed: the server still holds the
// name (a second save of it, which would be told OK and then lose to the commit, is
// refused; so is a delete) until the save is gone, and training is not held meanwhile.
TEST(CheckpointStoreTest, AWrittenSaveHoldsItsNameUntilItIsReleased) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  CheckpointStore& store = cluster.store(0);
  auto save = store.BeginSave("x", CheckpointKind::kFull, true, "job", Options(false, "a"));
  ASSERT_TRUE(save.ok()) << save.status();
  ASSERT_TRUE(store.PinSave(**save, store.JobVersions("job"), absl::InfiniteFuture()).ok());
  ASSERT_TRUE(store.FinishSave(**save, absl::InfiniteFuture()).ok());
  cluster.Step(0);  // the pins went with the write
  const absl::Status second = store.BeginSave("x", CheckpointKind::kFull, true, "job", Options(true, "b")).status();
  EXPECT_TRUE(absl::IsAlreadyExists(second)) << second;
  EXPECT_THAT(std::string(second.message()), HasSubstr("'x' is being saved"));
  EXPECT_TRUE(absl::IsFailedPrecondition(store.Delete("x")));
  ASSERT_TRUE(store.Commit("x", "a").ok());
  save->reset();
  const absl::Status after = store.BeginSave("x", CheckpointKind::kFull, true, "job", Options(true, "b")).status();
  EXPECT_TRUE(absl::IsAlreadyExists(after)) << after;
  EXPECT_THAT(std::string(after.message()), Not(HasSubstr("is being saved")));  // committed
  EXPECT_TRUE(store.Delete("x").ok());
}

// A blocking save whose client went away (its stream cancelled) stops at the next slice
// instead of writing on for a part no one will commit: Cancelled, its files removed, the
// groups' pins and the name released.
TEST(CheckpointStoreTest, ABlockingSaveWhoseClientWentAwayStopsAtOnceAndLeavesNothing) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  CheckpointStore& store = cluster.store(0);
  auto save = store.BeginSave("x", CheckpointKind::kSharded, true, "job", Options(false, "s"));
  ASSERT_TRUE(save.ok()) << save.status();
  ASSERT_TRUE(store.PinSave(**save, store.JobVersions("job"), absl::InfiniteFuture()).ok());
  int asked = 0;
  const absl::Status written = store.FinishSave(**save, absl::InfiniteFuture(), [&asked] { return ++asked > 2; });
  EXPECT_TRUE(absl::IsCancelled(written)) << written;
  EXPECT_EQ(asked, 3);  // nothing more once it said so
  EXPECT_FALSE(std::filesystem::exists(root + "/.x.partial"));
  cluster.Step(0);  // not held
  save->reset();
  EXPECT_TRUE(store.BeginSave("x", CheckpointKind::kSharded, true, "job", Options(false, "t")).ok());
  EXPECT_TRUE(Listing(store).empty());
}

// A blocking save whose every part is written, and whose client then ends the streams
// without the commit (it went away or cancelled): server 0, the one the commit would go
// to, removes the save; server 1 leaves its part to it. With a root per server (LOCAL),
// each server commits its own part, and so removes it.
TEST(CheckpointStoreTest, ABlockingSaveEndedWithoutItsCommitIsRemovedByItsCommitter) {
  const std::string root = FreshRoot();
  FakeCluster cluster(2, root);
  std::vector<std::unique_ptr<PendingSave>> saves;
  for (int rank = 0; rank < 2; ++rank) {
    CheckpointStore& store = cluster.store(rank);
    auto save = store.BeginSave("x", CheckpointKind::kSharded, true, "job", Options(false, "s"));
    ASSERT_TRUE(save.ok()) << save.status();
    ASSERT_TRUE(store.PinSave(**save, store.JobVersions("job"), absl::InfiniteFuture()).ok());
    ASSERT_TRUE(store.FinishSave(**save, absl::InfiniteFuture()).ok());
    saves.push_back(*std::move(save));
  }
  cluster.store(1).EndWithoutCommit(*saves[1]);
  EXPECT_TRUE(std::filesystem::exists(root + "/.x.partial/s/part-1.json"));
  cluster.store(0).EndWithoutCommit(*saves[0]);
  EXPECT_FALSE(std::filesystem::exists(root + "/.x.partial"));
  saves.clear();
  EXPECT_TRUE(Listing(cluster.store(0)).empty());

  const std::string own_root = FreshRoot();
  FakeCluster alone(2, own_root);
  SaveOptions per_server = Options(false, "t");
  per_server.root_per_server = true;
  auto local = alone.store(1).BeginSave("y", CheckpointKind::kLocal, true, "job", per_server);
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE(alone.store(1).PinSave(**local, alone.store(1).JobVersions("job"), absl::InfiniteFuture()).ok());
  ASSERT_TRUE(alone.store(1).FinishSave(**local, absl::InfiniteFuture()).ok());
  ASSERT_TRUE(std::filesystem::exists(own_root + "/.y.partial/t/part-1.json"));
  alone.store(1).EndWithoutCommit(**local);
  EXPECT_FALSE(std::filesystem::exists(own_root + "/.y.partial"));
}

// While a save of a name runs on a server (here: waiting for the version it cuts at),
// that server refuses a second save of the name and a delete of it; once it is done,
// both are accepted again.
TEST(CheckpointStoreTest, ASaveInProgressHoldsItsName) {
  const std::string root = FreshRoot();
  FakeCluster cluster(1, root);
  CheckpointStore& store = cluster.store(0);
  const std::map<std::string, int64_t> at_one = {{"emb", 1}, {"tiny", 1}, {"half", 1}};
  std::thread waiting([&] {
    EXPECT_TRUE(store.Save("x", CheckpointKind::kFull, false, "job", at_one, absl::Now() + absl::Seconds(30)).ok());
  });
  // The save creates its partial directory once it holds the name, before it waits.
  for (int i = 0; i < 500 && !std::filesystem::exists(root + "/.x.partial"); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Status second = store.Save("x", CheckpointKind::kFull, false, "job", at_one, absl::InfinitePast());
  EXPECT_TRUE(absl::IsAlreadyExists(second)) << second;
  EXPECT_THAT(std::string(second.message()), HasSubstr("'x' is being saved"));
  const absl::Status deleted = store.Delete("x");
  EXPECT_TRUE(absl::IsFailedPrecondition(deleted)) << deleted;
  EXPECT_THAT(std::string(deleted.message()), HasSubstr("delete it once the save completes"));
  cluster.Step(0);  // version 1: the waiting save writes its part
  waiting.join();
  ASSERT_TRUE(store.Commit("x").ok());
  EXPECT_TRUE(store.Delete("x").ok());
  // A save that failed before writing frees the name too, and leaves nothing behind.
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      store.Save("y", CheckpointKind::kFull, false, "job", {{"emb", 5}, {"tiny", 5}, {"half", 5}},
                 absl::Now() + absl::Milliseconds(10))));
  EXPECT_TRUE(absl::IsNotFound(store.Delete("y")));
  EXPECT_TRUE(cluster.Save("y", CheckpointKind::kFull, false, 1).ok());
}

}  // namespace
}  // namespace flatshard::server
