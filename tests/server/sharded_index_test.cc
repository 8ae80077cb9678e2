// index.json of SHARDED checkpoints: written from real shard files (safetensors headers
// built here, with names that need escaping; many files, read in parallel, in order),
// read back by ParseShardedIndex and by nlohmann's parser independently; damaged shard
// names, shards and indexes are DataLoss naming the file, and randomly damaged indexes
// get the verdict and pieces that a reader of nlohmann's JSON tree gives
// (FLATSHARD_FUZZ_SEED picks other damage).
#include "server/sharded_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
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

// The shard headers are read by several threads: the index still lists every file's
// pieces in the files' order, and a damaged shard among many is the one named.
TEST(ShardedIndexTest, ManyShardsAreIndexedInOrderAndADamagedOneIsNamed) {
  const testing::ScratchDir dir("sharded-index-many");
  constexpr int kShards = 9;
  std::vector<std::string> files;
  for (int r = 0; r < kShards; ++r) {
    files.push_back("shard-" + std::to_string(r) + ".safetensors");
    WriteShard(dir.path(), files.back(), {{"g/w@" + std::to_string(2 * r), DType::kFloat32, 2}});
  }
  const absl::StatusOr<std::string> text = ShardedIndexJson(dir.path(), files);
  ASSERT_TRUE(text.ok()) << text.status();
  const absl::StatusOr<ShardedIndex> index = ParseShardedIndex(*text, "index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->size(), 1u);
  const std::vector<StoredPiece>& pieces = index->at("g/w");
  ASSERT_EQ(pieces.size(), static_cast<size_t>(kShards));
  for (int r = 0; r < kShards; ++r) {
    EXPECT_EQ(pieces[r].file, files[r]);
    EXPECT_EQ(pieces[r].intra_start, 2 * r);
  }

  std::filesystem::resize_file(dir.path() + "/shard-5.safetensors", 4);
  const absl::StatusOr<std::string> damaged = ShardedIndexJson(dir.path(), files);
  ASSERT_FALSE(damaged.ok());
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(damaged.status().message()), HasSubstr("shard-5.safetensors"));
}

TEST(ShardedIndexTest, DamagedIndexesAreDataLossNamingTheFile) {
  // Other top-level keys (a later format's) are skipped, whatever they hold.
  const absl::StatusOr<ShardedIndex> good = ParseShardedIndex(
      R"({"format": {"v": [1, {"pieces": 2}]}, "pieces": {"g/w": [[4, 2, "f", 80], [0, 4, "e", 8]], "g/b": []},)"
      R"( "more": [[["x"]], null]})",
      "i.json");
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(good->size(), 2u);
  ExpectPieces(good->at("g/w"), {{"f", 4, 2, 80}, {"e", 0, 4, 8}}, "g/w");
  EXPECT_TRUE(good->at("g/b").empty());
  for (const char* text : {"", "not json", "[]", R"({"other": {}})", R"({"pieces": []})", R"({"pieces": {"k": 3}})",
                           R"({"pieces": {"k": [3]}})", R"({"pieces": {"k": [[0, 1, "f"]]}})",
                           R"({"pieces": {"k": [[0, 1, "f", 0, 5]]}})", R"({"pieces": {"k": [[-1, 1, "f", 0]]}})",
                           R"({"pieces": {"k": [[0.5, 1, "f", 0]]}})", R"({"pieces": {"k": [[0, 1, 2, 0]]}})",
                           R"({"pieces": {"k": [[0, 1, "f", -8]]}})", R"({"pieces": {"k": [[0, 1, "f", 1e999]]}})",
                           R"({"pieces": {"k": [[9223372036854775808, 1, "f", 0]]}})",
                           R"({"pieces": {"k": [[0, 9223372036854775808, "f", 0]]}})",
                           R"({"pieces": {"k": [["f", 0, 1, 0]]}})", R"({"pieces": {"k": [[0, 1, "f", 0], {}]}})",
                           R"({"pieces": {"k": [[0, 1, "f", 0]], "k": []}})", R"({"pieces": {}, "pieces": {}})",
                           R"({"pieces": {"k": []}} {})", R"({"pieces": {"k": [[0, 1, "f", 0]]})"}) {
    const absl::StatusOr<ShardedIndex> index = ParseShardedIndex(text, "ckpt/index.json");
    ASSERT_FALSE(index.ok()) << text;
    EXPECT_EQ(index.status().code(), absl::StatusCode::kDataLoss) << text;
    EXPECT_THAT(std::string(index.status().message()), HasSubstr("'ckpt/index.json' is ")) << text;
  }
}

// The index as a reader of nlohmann's JSON tree reads it (the reference for the SAX
// reader): nullopt where the text is not JSON, is not {"pieces": {key: [[count, count,
// file, offset], ...]}} (other top-level keys allowed), or lists "pieces" or a key of it
// twice (which the tree would keep once).
std::optional<ShardedIndex> ReadThroughATree(const std::string& text) {
  bool twice = false;
  std::string top_key;
  bool in_pieces = false;
  bool seen_pieces = false;
  std::set<std::string> keys;
  const auto watch = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1) {
      top_key = parsed.get<std::string>();
      twice |= top_key == "pieces" && seen_pieces;
      seen_pieces |= top_key == "pieces";
    } else if (event == Json::parse_event_t::key && depth == 2 && in_pieces) {
      twice |= !keys.insert(parsed.get<std::string>()).second;
    } else if (event == Json::parse_event_t::object_start && depth == 1) {
      in_pieces = top_key == "pieces";
    } else if (event == Json::parse_event_t::object_end && depth == 1) {
      in_pieces = false;
    }
    return true;
  };
  const Json json = Json::parse(text, watch, /*allow_exceptions=*/false);
  if (json.is_discarded() || twice || !json.is_object() || !json.contains("pieces") || !json["pieces"].is_object()) {
    return std::nullopt;
  }
  const auto count = [](const Json& value) {
    return value.is_number_unsigned() && value.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()};
  };
  ShardedIndex index;
  for (const auto& [key, list] : json["pieces"].items()) {
    if (!list.is_array()) return std::nullopt;
    std::vector<StoredPiece>& stored = index[key];
    for (const Json& piece : list) {
      if (!piece.is_array() || piece.size() != 4 || !count(piece[0]) || !count(piece[1]) || !piece[2].is_string() ||
          !piece[3].is_number_unsigned()) {
        return std::nullopt;
      }
      stored.push_back({piece[2].get<std::string>(), piece[0].get<int64_t>(), piece[1].get<int64_t>(),
                        piece[3].get<uint64_t>()});
    }
  }
  return index;
}

TEST(ShardedIndexTest, RandomlyDamagedIndexesReadAsThroughAJsonTree) {
  const char* seed = std::getenv("FLATSHARD_FUZZ_SEED");
  std::mt19937_64 rng(seed != nullptr ? std::strtoull(seed, nullptr, 10) : 20261127);
  const std::string alphabet = "[]{},:\"-.e0123456789 \\xpieces";
  int accepted = 0;
  for (int round = 0; round < 3000; ++round) {
    // A valid index: a few keys (one with escapes), lists of 0-3 pieces, maybe an
    // unknown top-level key before or after "pieces".
    Json pieces = Json::object();
    for (int k = 0, keys = static_cast<int>(rng() % 4); k < keys; ++k) {
      Json list = Json::array();
      for (int p = 0, n = static_cast<int>(rng() % 4); p < n; ++p) {
        list.push_back({rng() % 5000, rng() % 5000, k % 2 ? "shard-1.safetensors" : "s\"0", rng() % 100000});
      }
      pieces[k == 3 ? "g/\u00e9\n" : "g/t" + std::to_string(k)] = list;
    }
    Json index = {{"pieces", pieces}};
    if (rng() % 3 == 0) index[rng() % 2 ? "a" : "z"] = {{"x", {1, "y", nullptr}}};
    std::string text = index.dump(rng() % 2 ? -1 : 1);
    // 0-3 pieces of damage: a byte replaced, removed or repeated.
    for (int d = 0, damage = static_cast<int>(rng() % 4); d < damage && !text.empty(); ++d) {
      const size_t at = rng() % text.size();
      switch (rng() % 3) {
        case 0:
          text[at] = alphabet[rng() % alphabet.size()];
          break;
        case 1:
          text.erase(at, 1);
          break;
        default:
          text.insert(at, 1, text[at]);
      }
    }
    const std::optional<ShardedIndex> want = ReadThroughATree(text);
    const absl::StatusOr<ShardedIndex> got = ParseShardedIndex(text, "i.json");
    ASSERT_EQ(got.ok(), want.has_value()) << text << "\n" << got.status();
    if (!got.ok()) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
      continue;
    }
    ++accepted;
    ASSERT_EQ(got->size(), want->size()) << text;
    for (const auto& [key, list] : *want) {
      ASSERT_TRUE(got->count(key)) << text;
      ExpectPieces(got->at(key), list, key);
    }
  }
  EXPECT_GT(accepted, 300);  // the damage leaves enough indexes whole to compare pieces
}

}  // namespace
}  // namespace flatshard::server
