// Imports (server/checkpoint_import.h): what the files of a FULL state dict describe, as a
// checkpoint's manifest lists it, and what is refused; CheckpointStore's side of an
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
    return DescribeImport(dir_.path(), sizes_, version, specs_);
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
  absl::StatusOr<ImportedCheckpoint> imported = DescribeImport(dir.path(), sizes, 12, specs);
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
  EXPECT_THAT(DescribeImport(dir.path(), sizes, 0, specs).status().message(),
              HasSubstr("'model-00001-of-00002.safetensors' holds tensor 'x', which "
                        "'model.safetensors.index.json' maps to 'model-00002-of-00002.safetensors'"));
  index({{"x", "model-00001-of-00002.safetensors"}, {"y", "model-00001-of-00002.safetensors"}});
  EXPECT_THAT(DescribeImport(dir.path(), sizes, 0, specs).status().message(),
              HasSubstr("maps no tensor to 'model-00002-of-00002.safetensors'"));
  sizes.erase("model.safetensors.index.json");
  EXPECT_THAT(DescribeImport(dir.path(), sizes, 0, specs).status().message(),
              HasSubstr("'model-00001-of-00002.safetensors' comes without 'model.safetensors.index.json'"));
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
    const absl::Status committed = store.CommitImport(**import, 0).status();
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
  ASSERT_TRUE(store.CommitImport(**import, 3).ok());
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
