#include "server/sharded_index.h"

#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

namespace flatshard::server {

using Json = nlohmann::json;

namespace {

// A stored piece while the index is gathered: its file by number.
struct IndexedPiece {
  int64_t intra_start;
  int64_t numel;
  size_t file;
  uint64_t offset;
};

// `text` as a JSON string, quoted and escaped.
std::string Quoted(const std::string& text) { return Json(text).dump(); }

// A piece's element count or first element: a JSON integer in [0, 2^63).
bool IsCount(const Json& value) {
  return value.is_number_unsigned() && value.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()};
}

}  // namespace

absl::StatusOr<std::string> ShardedIndexJson(const std::string& dir, const std::vector<std::string>& files) {
  std::map<std::string, std::vector<IndexedPiece>> pieces;
  std::vector<std::string> quoted_files;
  try {
    for (size_t f = 0; f < files.size(); ++f) {
      const std::string path = absl::StrCat(dir, "/", files[f]);
      FLATSHARD_ASSIGN_OR_RETURN(const SafetensorsHeader header, SafetensorsHeader::Read(path));
      quoted_files.push_back(Quoted(files[f]));
      for (const SafetensorsTensor& t : header.tensors()) {
        const absl::string_view name = t.name;
        const size_t at = name.rfind('@');
        const size_t dot = at == absl::string_view::npos ? at : name.find('.', at);
        int64_t start = 0;
        if (at == absl::string_view::npos || !absl::SimpleAtoi(name.substr(at + 1, dot - at - 1), &start) ||
            start < 0 || t.dtype != DType::kFloat32) {
          return absl::DataLossError(
              absl::StrCat("'", path, "' has an unexpected tensor '", t.name, "' (", DTypeName(t.dtype), ")"));
        }
        std::string key(name.substr(0, at));
        if (dot != absl::string_view::npos) absl::StrAppend(&key, name.substr(dot));
        pieces[std::move(key)].push_back({start, static_cast<int64_t>((t.end - t.begin) / sizeof(float)), f,
                                          header.data_start() + t.begin});
      }
    }
    // Written as it goes: a JSON tree of every piece would cost more than the reads.
    std::string text = "{\"pieces\": {";
    const char* separator = "\n ";
    for (const auto& [key, list] : pieces) {
      absl::StrAppend(&text, separator, Quoted(key), ": [");
      separator = ",\n ";
      for (size_t i = 0; i < list.size(); ++i) {
        const IndexedPiece& piece = list[i];
        absl::StrAppend(&text, i == 0 ? "[" : ", [", piece.intra_start, ", ", piece.numel, ", ",
                        quoted_files[piece.file], ", ", piece.offset, "]");
      }
      text += "]";
    }
    text += "\n}}\n";
    return text;
  } catch (const Json::exception& error) {  // a name that is not UTF-8
    return absl::DataLossError(
        absl::StrCat("the shards in '", dir, "' name a tensor JSON cannot hold: ", error.what()));
  }
}

absl::StatusOr<ShardedIndex> ParseShardedIndex(const std::string& text, const std::string& path) {
  ShardedIndex index;
  try {
    const Json json = Json::parse(text);
    if (!json.is_object() || !json.contains("pieces") || !json["pieces"].is_object()) {
      return absl::DataLossError(absl::StrCat("'", path, "' is malformed: no \"pieces\" object"));
    }
    for (const auto& [key, list] : json["pieces"].items()) {
      if (!list.is_array()) {
        return absl::DataLossError(absl::StrCat("'", path, "' is malformed: \"", key, "\" is not a list of pieces"));
      }
      std::vector<StoredPiece>& stored = index[key];
      for (const Json& piece : list) {
        if (!piece.is_array() || piece.size() != 4 || !IsCount(piece[0]) || !IsCount(piece[1]) ||
            !piece[2].is_string() || !piece[3].is_number_unsigned()) {
          return absl::DataLossError(absl::StrCat("'", path, "' is malformed: piece ", piece.dump(), " of \"", key,
                                                  "\" is not [first element, numel, file, byte offset]"));
        }
        stored.push_back({piece[2].get<std::string>(), piece[0].get<int64_t>(), piece[1].get<int64_t>(),
                          piece[3].get<uint64_t>()});
      }
    }
  } catch (const Json::exception& error) {  // parse_error, or out_of_range for a number like 1e999
    return absl::DataLossError(absl::StrCat("'", path, "' is not valid JSON: ", error.what()));
  }
  return index;
}

}  // namespace flatshard::server
