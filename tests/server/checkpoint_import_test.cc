// Imports (server/checkpoint_import.h): what the files of a FULL or SHARDED state dict
// describe, as a checkpoint's manifest lists it, and what is refused; CheckpointStore's side of an
// import (its directory, commit and what a failed one leaves).
#include "server/checkpoint_import.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/file.h"
#include "core/safetensors.h"
#include "server/checkpoint_store.h"
#include "server/sharded_index.h"
#include "tests/scratch_dir.h"

namespace flatshard::server {
namespace {

using Json = nlohmann::json;
using ::testing::HasSubstr;

// Writes a safetensors file of `tensors` (zero-filled data) into `dir`; returns its size.
uint64_t WriteFile(const std::string& dir, const std::string& file, std::vector<SafetensorsTensor> tensors,
                   std::map<std::string, std::string> metadata = {}) {
  absl::StatusOr<SafetensorsHeader> header = SafetensorsHeader::Build(std::move(tensors), std::move(metadata));
  EXPECT_TRUE(header.ok()) << header.status();
  std::string bytes(reinterpret_cast<const char*>(header->bytes().data()), header->bytes().size());
  bytes.resize(header->file_size(), '\0');
  EXPECT_TRUE(WriteFileAtomically(dir + "/" + file, bytes).ok());
  return bytes.size();
}

SafetensorsTensor Tensor(const std::string& name, std::vector<int64_t> shape, DType dtype = DType::kFloat32) {
  return {name, dtype, std::move(shape)};
}

// An export of two groups: "a" (AdamW, tensors w and b, 5 steps at version 6) and "s"
// (SGD with momentum, tensor v, 5 steps, momentum state as an older export gives it:
// no ".momentum_initialized", no ".version").
class ImportedExport : public ::testing::Test {
 protected:
  void SetUp() override {
    sizes_["model.safetensors"] =
        WriteFile(dir_.path(), "model.safetensors",
                  {Tensor("w", {2, 3}), Tensor("b", {3}, DType::kBFloat16), Tensor("v", {4})}, {{"format", "pt"}});
    WriteState({Tensor("w.exp_avg", {2, 3}), Tensor("w.exp_avg_sq", {2, 3}), Tensor("b.exp_avg", {3}),
                Tensor("b.exp_avg_sq", {3}), Tensor("v.momentum_buffer", {4})});
  }
  void WriteState(std::vector<SafetensorsTensor> tensors, std::map<std::string, std::string> changes = {}) {
    std::map<std::string, std::string> metadata = {{"format", "pt"},  {"a.params", "w,b"},    {"a.optimizer", "adamw"},
                                                   {"a.step", "5"},   {"a.version", "6"},     {"a.hyperparams", "{}"},
                                                   {"s.params", "v"}, {"s.optimizer", "sgd"}, {"s.step", "5"}};
    for (const auto& [key, value] : changes) {
      if (value.empty()) {
        metadata.erase(key);
      } else {
        metadata[key] = value;
      }
    }
    sizes_["optimizer.safetensors"] = WriteFile(dir_.path(), "optimizer.safetensors", std::move(tensors), metadata);
  }
  absl::StatusOr<ImportedCheckpoint> Describe(int64_t version = 0) {
    return DescribeImport(dir_.path(), sizes_, version, /*weights_only=*/false, specs_);
  }

  const testing::ScratchDir dir_{"import"};
  std::map<std::string, uint64_t> sizes_;
  Json specs_;
};

TEST_F(ImportedExport, DescribesTheGroupsAsTheirSaveWould) {
  absl::StatusOr<ImportedCheckpoint> imported = Describe(/*version=*/9);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->optimizer);
  EXPECT_EQ(imported->groups, (std::vector<std::string>{"a", "s"}));
  const Json expected = Json::parse(R"([
    {"name": "a", "tensors": [{"name": "w", "shape": [2, 3], "dtype": "float32"},
                              {"name": "b", "shape": [3], "dtype": "bfloat16"}],
     "version": 6, "optimizer": "adamw", "optimizer_steps": 5, "momentum_initialized": false,
     "state": ["exp_avg", "exp_avg_sq"]},
    {"name": "s", "tensors": [{"name": "v", "shape": [4], "dtype": "float32"}],
     "version": 9, "optimizer": "sgd", "optimizer_steps": 5, "momentum_initialized": true,
     "state": ["momentum_buffer"]}])");
  EXPECT_EQ(specs_, expected) << specs_.dump(1);
}

TEST_F(ImportedExport, SaysWhatIsWrongWithFilesThatAreNoStateDict) {
  const std::vector<SafetensorsTensor> state = {Tensor("w.exp_avg", {2, 3}), Tensor("w.exp_avg_sq", {2, 3}),
                                                Tensor("b.exp_avg", {3}), Tensor("b.exp_avg_sq", {3}),
                                                Tensor("v.momentum_buffer", {4})};
  struct Case {
    std::vector<SafetensorsTensor> tensors;
    std::map<std::string, std::string> metadata;
    std::string message;
  };
  std::vector<Case> cases = {
      {state, {{"s.params", ""}}, "model tensor 'v' is in no group of the optimizer metadata"},
      {state, {{"s.params", "v,w"}}, "lists tensor 'w' in groups 'a' and 's'"},
      {state, {{"s.params", "v,x"}}, "group 's' of the optimizer metadata lists tensor 'x', which the model"},
      {state, {{"a.step", "-1"}}, "'a.step' is '-1'; it must be an integer >= 0"},
      {state, {{"a.optimizer", ""}}, "lacks 'a.optimizer'"},
      {{state[0], state[1], state[2], state[4]}, {}, "lacks 'b.exp_avg_sq'"},
      {{state[0], state[1], state[2], state[3], state[4], Tensor("b.max_exp_avg_sq", {3})},
       {},
       "also holds 'b.max_exp_avg_sq'"},
      {{state[0], state[1], state[2], state[3], Tensor("v.momentum_buffer", {2, 2})},
       {},
       "'v.momentum_buffer' must be float32 of the tensor's shape [4]"},
      {{state[0], state[1], state[2], state[3], state[4], Tensor("stray", {1})},
       {},
       "optimizer tensor 'stray' is the state of no tensor of the groups"},
  };
  for (const Case& c : cases) {
    WriteState(c.tensors, c.metadata);
    const absl::StatusOr<ImportedCheckpoint> imported = Describe();
    EXPECT_TRUE(absl::IsInvalidArgument(imported.status())) << c.message << ": " << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(c.message));
  }
  WriteState(state);
  ASSERT_TRUE(Describe().ok());
  // Files: a name no state dict has, a size other than the header's, no model file.
  sizes_["notes.txt"] = 1;
  EXPECT_THAT(Describe().status().message(), HasSubstr("'notes.txt' is not a file of a FULL state dict"));
  sizes_.erase("notes.txt");
  sizes_["model.safetensors"] += 8;
  EXPECT_THAT(Describe().status().message(), HasSubstr("'model.safetensors' has"));
  sizes_.erase("model.safetensors");
  EXPECT_THAT(Describe().status().message(), HasSubstr("the import holds no model.safetensors"));
}

TEST(DescribeImport, ASplitWeightsOnlyFileIsOneGroupAtTheVersionAsked) {
  const testing::ScratchDir dir("import-split");
  std::map<std::string, uint64_t> sizes;
  sizes["model-00001-of-00002.safetensors"] =
      WriteFile(dir.path(), "model-00001-of-00002.safetensors", {Tensor("x", {2}), Tensor("y", {3})});
  sizes["model-00002-of-00002.safetensors"] =
      WriteFile(dir.path(), "model-00002-of-00002.safetensors", {Tensor("z", {1}, DType::kFloat16)});
  auto index = [&](const Json& weight_map) {
    const std::string text = Json{{"metadata", Json::object()}, {"weight_map", weight_map}}.dump();
    ASSERT_TRUE(WriteFileAtomically(dir.path() + "/model.safetensors.index.json", text).ok());
    sizes["model.safetensors.index.json"] = text.size();
  };
  Json specs;
  index({{"x", "model-00001-of-00002.safetensors"},
         {"y", "model-00001-of-00002.safetensors"},
         {"z", "model-00002-of-00002.safetensors"}});
  absl::StatusOr<ImportedCheckpoint> imported = DescribeImport(dir.path(), sizes, 12, false, specs);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_FALSE(imported->optimizer);
  EXPECT_EQ(imported->groups, std::vector<std::string>{"imported"});
  EXPECT_EQ(specs, Json::parse(R"([{"name": "imported", "tensors": [
      {"name": "x", "shape": [2], "dtype": "float32"}, {"name": "y", "shape": [3], "dtype": "float32"},
      {"name": "z", "shape": [1], "dtype": "float16"}], "version": 12, "optimizer": "",
      "optimizer_steps": 0, "momentum_initialized": false, "state": []}])"));
  // An index that maps a tensor to another file, or misses a file.
  index({{"x", "model-00002-of-00002.safetensors"},
         {"y", "model-00001-of-00002.safetensors"},
         {"z", "model-00002-of-00002.safetensors"}});
  EXPECT_THAT(DescribeImport(dir.path(), sizes, 0, false, specs).status().message(),
              HasSubstr("'model-00001-of-00002.safetensors' holds tensor 'x', which "
                        "'model.safetensors.index.json' maps to 'model-00002-of-00002.safetensors'"));
  index({{"x", "model-00001-of-00002.safetensors"}, {"y", "model-00001-of-00002.safetensors"}});
  EXPECT_THAT(DescribeImport(dir.path(), sizes, 0, false, specs).status().message(),
              HasSubstr("maps no tensor to 'model-00002-of-00002.safetensors'"));
  sizes.erase("model.safetensors.index.json");
  EXPECT_THAT(DescribeImport(dir.path(), sizes, 0, false, specs).status().message(),
              HasSubstr("'model-00001-of-00002.safetensors' comes without 'model.safetensors.index.json'"));
}

// A SHARDED export of two servers: group "a" (Adam: w of 2x3, 5 steps at version 6) and
// "s" (SGD with momentum: v of 4), each tensor's pieces split 4 + 2 and 2 + 2 between
// shard 0 and shard 1, each state's as its tensor's; shard 0 describes them.
class ImportedShardedExport : public ::testing::Test {
 protected:
  void SetUp() override {
    description_ = Json::parse(R"({"shards": 2, "optimizer": true, "groups": [
      {"name": "a", "align": 4, "tensors": [{"name": "w", "shape": [2, 3], "dtype": "bfloat16"}],
       "version": 6, "optimizer": "adam", "optimizer_steps": 5, "momentum_initialized": false,
       "state": ["exp_avg", "exp_avg_sq"]},
      {"name": "s", "align": 4, "tensors": [{"name": "v", "shape": [4], "dtype": "float32"}],
       "version": 6, "optimizer": "sgd", "optimizer_steps": 5, "momentum_initialized": true,
       "state": ["momentum_buffer"]}]})");
    shards_ = {Pieces({{"a/w@0", 4}, {"s/v@0", 2}}), Pieces({{"a/w@4", 2}, {"s/v@2", 2}})};
  }
  // The pieces (name, elements) of a shard, each with its states' pieces.
  static std::vector<SafetensorsTensor> Pieces(const std::vector<std::pair<std::string, int64_t>>& pieces) {
    std::vector<SafetensorsTensor> tensors;
    for (const auto& [name, numel] : pieces) {
      const std::vector<std::string> states = name[0] == 'a' ? std::vector<std::string>{".exp_avg", ".exp_avg_sq"}
                                                             : std::vector<std::string>{".momentum_buffer"};
      tensors.push_back(Tensor(name, {numel}));
      for (const std::string& state : states) tensors.push_back(Tensor(name + state, {numel}));
    }
    return tensors;
  }
  absl::StatusOr<ImportedCheckpoint> Describe(bool weights_only = false) {
    sizes_.clear();
    for (size_t i = 0; i < shards_.size(); ++i) {
      const std::string file = "shard-" + std::to_string(i) + ".safetensors";
      std::map<std::string, std::string> metadata;
      if (i == 0 && !description_.is_null()) metadata["flatshard.sharded"] = description_.dump();
      sizes_[file] = WriteFile(dir_.path(), file, shards_[i], metadata);
    }
    return DescribeImport(dir_.path(), sizes_, /*version=*/0, weights_only, specs_);
  }

  const testing::ScratchDir dir_{"import-sharded"};
  Json description_;
  std::vector<std::vector<SafetensorsTensor>> shards_;
  std::map<std::string, uint64_t> sizes_;
  Json specs_;
};

TEST_F(ImportedShardedExport, DescribesTheGroupsAndIndexesThePieces) {
  absl::StatusOr<ImportedCheckpoint> imported = Describe();
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->kind, CheckpointKind::kSharded);
  EXPECT_TRUE(imported->optimizer);
  EXPECT_EQ(imported->shards, 2);
  EXPECT_EQ(imported->groups, (std::vector<std::string>{"a", "s"}));
  Json expected = description_["groups"];
  for (Json& group : expected) group.erase("align");  // only a LOCAL load reads it
  EXPECT_EQ(specs_, expected) << specs_.dump(1);
  // The index a SHARDED save's commit writes: shard 1's piece of w's exp_avg_sq at its
  // offset in that file.
  absl::StatusOr<ShardedIndex> index = ParseShardedIndex(imported->index_json, "index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ((*index)["a/w.exp_avg_sq"].size(), 2u);
  const StoredPiece& piece = (*index)["a/w.exp_avg_sq"][1];
  absl::StatusOr<SafetensorsHeader> shard1 = SafetensorsHeader::Read(dir_.path() + "/shard-1.safetensors");
  ASSERT_TRUE(shard1.ok());
  EXPECT_EQ(piece.file, "shard-1.safetensors");
  EXPECT_EQ(piece.intra_start, 4);
  EXPECT_EQ(piece.numel, 2);
  EXPECT_EQ(piece.offset, shard1->data_start() + shard1->Find("a/w@4.exp_avg_sq")->begin);

  // Weights only: the groups keep their versions, not their optimizer state.
  imported = Describe(/*weights_only=*/true);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_FALSE(imported->optimizer);
  for (const Json& group : specs_) {
    EXPECT_EQ(group["version"], 6);
    EXPECT_EQ(group["optimizer_steps"], 0);
    EXPECT_EQ(group["state"], Json::array());
    EXPECT_EQ(group["momentum_initialized"], false);
  }
}

TEST_F(ImportedShardedExport, SaysWhatIsWrongWithTheFilesOrTheirDescription) {
  const Json description = description_;
  const std::vector<std::vector<SafetensorsTensor>> shards = shards_;
  struct Case {
    std::string field;  // a JSON pointer into the description, empty: none
    Json value;
    std::string message;
  };
  const std::vector<Case> description_cases = {
      {"/shards", 0, "shards must be between 1 and 1048576"},
      {"/optimizer", "yes", "has no 'optimizer' boolean"},
      {"/groups", Json::array(), "lists no groups"},
      {"/groups/0/name", "a/b", "without '/'"},
      {"/groups/1/name", "a", "must be unique"},
      {"/groups/0/version", -1, "group 'a': \"version\" must be a non-negative integer, not -1"},
      {"/groups/0/optimizer_steps", "5", "group 'a': \"optimizer_steps\" must be a non-negative integer"},
      {"/groups/0/momentum_initialized", 1, "has no 'momentum_initialized' boolean"},
      {"/groups/0/state/1", "exp_avg", "lists optimizer state \"exp_avg\""},
      {"/groups/0/state/1", "velocity", "lists optimizer state \"velocity\""},
      {"/groups/0/tensors", Json::array(), "group 'a' has no tensors"},
      {"/groups/0/tensors/0/dtype", "int7", "tensor 'w' of group 'a': "},
      {"/groups/0/tensors/0/shape", Json::array({2, -3}), "tensor 'w' of group 'a' has shape [2,-3]"},
      {"/groups/0/tensors/0/shape", Json::array({int64_t{1} << 30, int64_t{1} << 30}), "at most 2^50 elements"},
      {"/groups/1/tensors/0/shape", Json::array({5}), "the shard files hold 4 elements of 's/v', whose tensor has 5"},
  };
  for (const Case& c : description_cases) {
    description_ = description;
    description_[Json::json_pointer(c.field)] = c.value;
    const absl::StatusOr<ImportedCheckpoint> imported = Describe();
    EXPECT_TRUE(absl::IsInvalidArgument(imported.status())) << c.field << ": " << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(c.message)) << c.field;
  }
  description_ = description;
  description_["groups"][1].erase("version");
  EXPECT_THAT(Describe().status().message(), HasSubstr("group 's': \"version\" is missing"));
  description_ = description;
  ASSERT_TRUE(Describe().ok());

  struct PiecesCase {
    std::vector<std::vector<SafetensorsTensor>> shards;
    std::string message;
  };
  const std::vector<PiecesCase> pieces_cases = {
      {{shards[0], Pieces({{"a/w@3", 3}, {"s/v@2", 2}})}, "elements [3, 4) of 'a/w' twice"},
      {{shards[0], Pieces({{"a/w@5", 1}, {"s/v@2", 2}})}, "elements [4, 5) of 'a/w' in none"},
      {{shards[0], Pieces({{"s/v@2", 2}})}, "the shard files hold 4 elements of 'a/w', whose tensor has 6"},
      {{shards[0], Pieces({{"a/w@4", 2}, {"s/v@2", 2}, {"a/x@0", 1}})},
       "hold pieces of 'a/x', which the description lists no tensor"},
      {{shards[0], {Tensor("a/w@4", {2}), Tensor("a/w@4.exp_avg", {2}), Tensor("s/v@2", {2}),
                    Tensor("s/v@2.momentum_buffer", {2})}},
       "the shard files hold 4 elements of 'a/w.exp_avg_sq', whose tensor has 6"},
      {{shards[0], {Tensor("a/w-4", {2})}}, "has an unexpected tensor 'a/w-4'"},
  };
  for (const PiecesCase& c : pieces_cases) {
    shards_ = c.shards;
    const absl::StatusOr<ImportedCheckpoint> imported = Describe();
    EXPECT_TRUE(absl::IsInvalidArgument(imported.status())) << c.message << ": " << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(c.message));
  }
  shards_ = shards;

  // Files: shard 0 without its description; a shard missing; a file beside the shards.
  description_ = Json();
  EXPECT_THAT(Describe().status().message(), HasSubstr("'shard-0.safetensors' has no 'flatshard.sharded' metadata"));
  description_ = description;
  ASSERT_TRUE(Describe().ok());
  sizes_.erase("shard-1.safetensors");
  EXPECT_THAT(DescribeImport(dir_.path(), sizes_, 0, false, specs_).status().message(),
              HasSubstr("the import lacks 'shard-1.safetensors' of the 2 shard files"));
  ASSERT_TRUE(Describe().ok());
  sizes_["model.safetensors"] = WriteFile(dir_.path(), "model.safetensors", {Tensor("w", {2, 3})});
  EXPECT_THAT(DescribeImport(dir_.path(), sizes_, 0, false, specs_).status().message(),
              HasSubstr("holds 'model.safetensors' beside the 2 shard files"));
  sizes_.erase("model.safetensors");
  sizes_["shard-01.safetensors"] = 8;
  EXPECT_THAT(DescribeImport(dir_.path(), sizes_, 0, false, specs_).status().message(),
              HasSubstr("'shard-01.safetensors' is not a file of a FULL state dict"));
}

TEST(CheckpointStoreImport, CommitsWhatWasSentWholeAndLeavesNothingOtherwise) {
  const testing::ScratchDir root("import-store");
  const testing::ScratchDir source("import-source");
  const uint64_t size = WriteFile(source.path(), "model.safetensors", {Tensor("x", {1000})});
  absl::StatusOr<std::string> bytes = ReadFileToString(source.path() + "/model.safetensors");
  ASSERT_TRUE(bytes.ok());
  const auto span = [&](uint64_t begin, uint64_t end) {
    return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bytes->data()) + begin, end - begin);
  };
  Registry registry(0, 2);
  CheckpointStore store(registry, 0, 2, root.path());
  Registry other_registry(1, 2);
  CheckpointStore other(other_registry, 1, 2, root.path());
  EXPECT_THAT(other.BeginImport("x").status().message(), HasSubstr("imports go to server 0"));
  auto listed = [&] {
    const absl::StatusOr<std::vector<CheckpointInfo>> infos = store.List();
    std::vector<std::string> names;
    for (const CheckpointInfo& info : infos.value()) names.push_back(info.name + (info.complete ? "" : "?"));
    return names;
  };
  {  // Half of the file sent: refused, and nothing stays once the import is gone.
    absl::StatusOr<std::unique_ptr<PendingImport>> import = store.BeginImport("x");
    ASSERT_TRUE(import.ok()) << import.status();
    EXPECT_TRUE(absl::IsAlreadyExists(store.BeginImport("x").status()));  // one at a time
    ASSERT_TRUE((*import)->sink().Open("model.safetensors", size, true).ok());
    ASSERT_TRUE((*import)->sink().Write("model.safetensors", 0, span(0, size / 2)).ok());
    ASSERT_TRUE((*import)->sink().Close("model.safetensors").ok());
    const absl::Status committed = store.CommitImport(**import, 0, false).status();
    EXPECT_TRUE(absl::IsInvalidArgument(committed)) << committed;
    EXPECT_THAT(committed.message(), HasSubstr("of the " + std::to_string(size) + " bytes of 'model.safetensors'"));
    EXPECT_EQ(listed(), std::vector<std::string>{"x?"});
  }
  EXPECT_EQ(listed(), std::vector<std::string>{});
  absl::StatusOr<std::unique_ptr<PendingImport>> import = store.BeginImport("x");
  ASSERT_TRUE(import.ok()) << import.status();
  ASSERT_TRUE((*import)->sink().Open("model.safetensors", size, true).ok());
  ASSERT_TRUE((*import)->sink().Write("model.safetensors", 0, span(0, size)).ok());
  ASSERT_TRUE((*import)->sink().Close("model.safetensors").ok());
  ASSERT_TRUE(store.CommitImport(**import, 3, false).ok());
  import->reset();
  const std::vector<CheckpointInfo> infos = *store.List();
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_TRUE(infos[0].complete);
  EXPECT_EQ(infos[0].kind, "full");
  EXPECT_EQ(infos[0].versions, (std::map<std::string, int64_t>{{"imported", 3}}));
  EXPECT_TRUE(absl::IsAlreadyExists(store.BeginImport("x").status()));
}

}  // namespace
}  // namespace flatshard::server
