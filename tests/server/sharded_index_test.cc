// index.json of SHARDED checkpoints: written from real shard files (safetensors headers
// built here, with names that need escaping), read back by ParseShardedIndex and by
// nlohmann's parser independently; damaged shard names and damaged indexes are DataLoss
// naming the file.
#include "server/sharded_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/file.h"
#include "core/safetensors.h"
#include "tests/scratch_dir.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// Writes a safetensors file `dir`/`file` (afresh) with `tensors` (name, dtype, numel;
// zero bytes) and returns its header.
SafetensorsHeader WriteShard(const std::string& dir, const std::string& file,
                             const std::vector<std::tuple<std::string, DType, int64_t>>& tensors) {
  std::vector<SafetensorsTensor> entries;
  for (const auto& [name, dtype, numel] : tensors) entries.push_back({name, dtype, {numel}, 0, 0});
  absl::StatusOr<SafetensorsHeader> header = SafetensorsHeader::Build(std::move(entries), {});
  EXPECT_TRUE(header.ok()) << header.status();
  std::filesystem::remove(dir + "/" + file);
  absl::StatusOr<File> out = File::Open(dir + "/" + file, File::Mode::kWrite);
  EXPECT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->WriteAt(0, header->bytes()).ok());
  const std::vector<std::byte> zeros(header->file_size() - header->data_start());
  EXPECT_TRUE(out->WriteAt(header->data_start(), zeros).ok());
  return *std::move(header);
}

// Where `tensor` of `header` (in `file`) starts, as a stored piece from `start`.
StoredPiece PieceOf(const SafetensorsHeader& header, const std::string& file, const std::string& tensor,
                    int64_t start) {
  const SafetensorsTensor* t = header.Find(tensor);
  EXPECT_NE(t, nullptr) << tensor;
  return {file, start, static_cast<int64_t>((t->end - t->begin) / sizeof(float)), header.data_start() + t->begin};
}

void ExpectPieces(const std::vector<StoredPiece>& got, const std::vector<StoredPiece>& want, const std::string& key) {
  ASSERT_EQ(got.size(), want.size()) << key;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].file, want[i].file) << key << " " << i;
    EXPECT_EQ(got[i].intra_start, want[i].intra_start) << key << " " << i;
    EXPECT_EQ(got[i].numel, want[i].numel) << key << " " << i;
    EXPECT_EQ(got[i].offset, want[i].offset) << key << " " << i;
  }
}

TEST(ShardedIndexTest, PiecesOfEveryShardRoundTrip) {
  const testing::ScratchDir dir("sharded-index");
  // "g/w" (10 elements) is split across both shards; the last group's name needs JSON
  // escapes and is not ASCII.
  const std::string odd = "h \"q\\\" \xc3\xbc" "n\xc3\xaf" "c\xc3\xb8" "de/t.x";
  const SafetensorsHeader s0 = WriteShard(dir.path(), "shard-0.safetensors",
                                          {{"g/w@0", DType::kFloat32, 6},
                                           {"g/w@0.exp_avg", DType::kFloat32, 6},
                                           {"g/b@0", DType::kFloat32, 3}});
  const SafetensorsHeader s1 = WriteShard(dir.path(), "shard-1.safetensors",
                                          {{"g/w@6", DType::kFloat32, 4},
                                           {"g/w@6.exp_avg", DType::kFloat32, 4},
                                           {odd + "@0", DType::kFloat32, 2},
                                           {odd + "@0.momentum_buffer", DType::kFloat32, 2}});
  const absl::StatusOr<std::string> text =
      ShardedIndexJson(dir.path(), {"shard-0.safetensors", "shard-1.safetensors"});
  ASSERT_TRUE(text.ok()) << text.status();

  const std::map<std::string, std::vector<StoredPiece>> want = {
      {"g/w", {PieceOf(s0, "shard-0.safetensors", "g/w@0", 0), PieceOf(s1, "shard-1.safetensors", "g/w@6", 6)}},
      {"g/w.exp_avg",
       {PieceOf(s0, "shard-0.safetensors", "g/w@0.exp_avg", 0),
        PieceOf(s1, "shard-1.safetensors", "g/w@6.exp_avg", 6)}},
      {"g/b", {PieceOf(s0, "shard-0.safetensors", "g/b@0", 0)}},
      {odd, {PieceOf(s1, "shard-1.safetensors", odd + "@0", 0)}},
      {odd + ".momentum_buffer", {PieceOf(s1, "shard-1.safetensors", odd + "@0.momentum_buffer", 0)}},
  };
  const absl::StatusOr<ShardedIndex> index = ParseShardedIndex(*text, "index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->size(), want.size());
  for (const auto& [key, pieces] : want) {
    ASSERT_TRUE(index->count(key)) << key;
    ExpectPieces(index->at(key), pieces, key);
  }
  // The same pieces by a reader that is not ours.
  const Json json = Json::parse(*text);
  ASSERT_EQ(json.size(), 1u);
  ASSERT_EQ(json.at("pieces").size(), want.size());
  for (const auto& [key, pieces] : want) {
    const Json& listed = json.at("pieces").at(key);
    ASSERT_EQ(listed.size(), pieces.size()) << key;
    for (size_t i = 0; i < pieces.size(); ++i) {
      EXPECT_EQ(listed[i], Json::array({pieces[i].intra_start, pieces[i].numel, pieces[i].file, pieces[i].offset}))
          << key;
    }
  }
}

TEST(ShardedIndexTest, ShardTensorsNotNamedAsShardsNameThemAreDataLoss) {
  const testing::ScratchDir dir("sharded-index-bad");
  const std::vector<std::pair<std::string, DType>> bad = {
      {"g/w", DType::kFloat32},    {"g/w@", DType::kFloat32},     {"g/w@x", DType::kFloat32},
      {"g/w@-3", DType::kFloat32}, {"g/w@1x.exp_avg", DType::kFloat32}, {"g/w@0", DType::kBFloat16},
  };
  for (const auto& [name, dtype] : bad) {
    WriteShard(dir.path(), "shard-0.safetensors", {{"g/b@0", DType::kFloat32, 2}, {name, dtype, 4}});
    const absl::StatusOr<std::string> text = ShardedIndexJson(dir.path(), {"shard-0.safetensors"});
    ASSERT_FALSE(text.ok()) << name;
    EXPECT_EQ(text.status().code(), absl::StatusCode::kDataLoss) << name;
    EXPECT_THAT(std::string(text.status().message()),
                HasSubstr("shard-0.safetensors' has an unexpected tensor '" + name + "'"));
  }
  EXPECT_FALSE(ShardedIndexJson(dir.path(), {"missing.safetensors"}).ok());
}

TEST(ShardedIndexTest, DamagedIndexesAreDataLossNamingTheFile) {
  const absl::StatusOr<ShardedIndex> good = ParseShardedIndex(R"({"pieces": {"g/w": [[4, 2, "f", 80]]}})", "i.json");
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectPieces(good->at("g/w"), {{"f", 4, 2, 80}}, "g/w");
  for (const char* text : {"", "not json", "[]", R"({"other": {}})", R"({"pieces": []})", R"({"pieces": {"k": 3}})",
                           R"({"pieces": {"k": [3]}})", R"({"pieces": {"k": [[0, 1, "f"]]}})",
                           R"({"pieces": {"k": [[0, 1, "f", 0, 5]]}})", R"({"pieces": {"k": [[-1, 1, "f", 0]]}})",
                           R"({"pieces": {"k": [[0.5, 1, "f", 0]]}})", R"({"pieces": {"k": [[0, 1, 2, 0]]}})",
                           R"({"pieces": {"k": [[0, 1, "f", -8]]}})", R"({"pieces": {"k": [[0, 1, "f", 1e999]]}})",
                           R"({"pieces": {"k": [[9223372036854775808, 1, "f", 0]]}})",
                           R"({"pieces": {"k": [[0, 9223372036854775808, "f", 0]]}})"}) {
    const absl::StatusOr<ShardedIndex> index = ParseShardedIndex(text, "ckpt/index.json");
    ASSERT_FALSE(index.ok()) << text;
    EXPECT_EQ(index.status().code(), absl::StatusCode::kDataLoss) << text;
    EXPECT_THAT(std::string(index.status().message()), HasSubstr("'ckpt/index.json' is ")) << text;
  }
}

}  // namespace
}  // namespace flatshard::server
