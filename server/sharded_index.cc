#include "server/sharded_index.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>
#include <thread>

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

// Appends `text` as a JSON string, quoted and escaped, to `out`. Printable ASCII other
// than '"' and '\\' goes as it is (every name WriteShards makes, in practice); anything
// else through nlohmann, which escapes it and throws for text that is not UTF-8.
void AppendQuoted(std::string& out, const std::string& text) {
  const bool plain = std::all_of(text.begin(), text.end(), [](char c) {
    return c >= 0x20 && c <= 0x7e && c != '"' && c != '\\';
  });
  if (!plain) {
    out += Json(text).dump();
    return;
  }
  out += '"';
  out += text;
  out += '"';
}

// Reads index.json into a ShardedIndex as nlohmann's SAX parser meets its values: for
// 20000 groups the index is 12 MB, whose JSON tree costs more to build and free than
// the text to lex. Values under other top-level keys than "pieces" are skipped. Stops at
// the first value out of place; error() says what, or is empty once the whole text was
// read as an index.
class IndexReader final : public nlohmann::json_sax<Json> {
 public:
  explicit IndexReader(ShardedIndex& index) : index_(index) {}

  const std::string& error() const { return error_; }

  bool null() override { return Other(); }
  bool boolean(bool) override { return Other(); }
  bool number_integer(number_integer_t value) override {
    return value < 0 ? Other() : Count(static_cast<uint64_t>(value));
  }
  bool number_unsigned(number_unsigned_t value) override { return Count(value); }
  bool number_float(number_float_t, const string_t&) override { return Other(); }
  bool binary(binary_t&) override { return Other(); }

  bool string(string_t& value) override {
    if (skip_ > 0 || pending_skip_) return Skipped();
    if (at_ != At::kPiece || field_ != 2) return Other();
    piece_.file = std::move(value);
    ++field_;
    return true;
  }

  bool start_object(std::size_t) override {
    if (skip_ > 0 || pending_skip_) return Enter();
    switch (at_) {
      case At::kStart:
        at_ = At::kTop;
        return true;
      case At::kTop:
        at_ = At::kPieces;
        return true;
      default:
        return Other();
    }
  }

  bool key(string_t& key) override {
    if (skip_ > 0) return true;
    if (at_ == At::kTop) {
      if (key != "pieces") {
        pending_skip_ = true;
        return true;
      }
      if (seen_pieces_) return Fail("malformed: it lists \"pieces\" twice");
      seen_pieces_ = true;
      return true;
    }
    // At::kPieces: a tensor's key, whose list follows.
    const auto [it, inserted] = index_.try_emplace(key);
    if (!inserted) return Fail(absl::StrCat("malformed: it lists \"", key, "\" twice"));
    list_ = &it->second;
    key_ = it->first;
    return true;
  }

  bool end_object() override {
    if (skip_ > 0) return Leave();
    if (at_ == At::kPieces) {
      at_ = At::kTop;
    } else {  // At::kTop
      at_ = At::kDone;
      if (!seen_pieces_) return Fail("malformed: no \"pieces\" object");
    }
    return true;
  }

  bool start_array(std::size_t) override {
    if (skip_ > 0 || pending_skip_) return Enter();
    if (at_ == At::kPieces) {
      at_ = At::kList;
      return true;
    }
    if (at_ == At::kList) {
      at_ = At::kPiece;
      piece_ = StoredPiece();
      field_ = 0;
      return true;
    }
    return Other();
  }

  bool end_array() override {
    if (skip_ > 0) return Leave();
    if (at_ == At::kList) {
      at_ = At::kPieces;
      return true;
    }
    // At::kPiece
    if (field_ != 4) return BadPiece();
    list_->push_back(std::move(piece_));
    at_ = At::kList;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& error) override {
    // parse_error, or out_of_range for a number like 1e999
    return Fail(absl::StrCat("not valid JSON: ", error.what()));
  }

 private:
  // Where the reader is: before the text, in the top-level object, in "pieces", in a
  // tensor's list of pieces, in one piece, after the text.
  enum class At { kStart, kTop, kPieces, kList, kPiece, kDone };

  bool Fail(std::string error) {
    if (error_.empty()) error_ = std::move(error);
    return false;
  }
  bool BadPiece() {
    return Fail(absl::StrCat("malformed: piece ", list_->size(), " of \"", key_,
                             "\" is not [first element, numel, file, byte offset]"));
  }
  // A value that has no place where it is.
  bool Other() {
    if (skip_ > 0 || pending_skip_) return Skipped();
    switch (at_) {
      case At::kStart:
      case At::kDone:
        return Fail("malformed: not a JSON object");
      case At::kTop:
        return Fail("malformed: no \"pieces\" object");
      case At::kPieces:
        return Fail(absl::StrCat("malformed: \"", key_, "\" is not a list of pieces"));
      case At::kList:
      case At::kPiece:
        return BadPiece();
    }
    return false;
  }
  // A count of a piece (first element, numel: below 2^63) or its byte offset.
  bool Count(uint64_t value) {
    if (skip_ > 0 || pending_skip_) return Skipped();
    if (at_ != At::kPiece) return Other();
    if (field_ == 0 || field_ == 1) {
      if (value > uint64_t{std::numeric_limits<int64_t>::max()}) return BadPiece();
      (field_ == 0 ? piece_.intra_start : piece_.numel) = static_cast<int64_t>(value);
    } else if (field_ == 3) {
      piece_.offset = value;
    } else {
      return BadPiece();
    }
    ++field_;
    return true;
  }
  // A scalar under a skipped key (or the skipped value itself).
  bool Skipped() {
    pending_skip_ = false;
    return true;
  }
  bool Enter() {
    pending_skip_ = false;
    ++skip_;
    return true;
  }
  bool Leave() {
    --skip_;
    return true;
  }

  ShardedIndex& index_;
  At at_ = At::kStart;
  bool seen_pieces_ = false;
  bool pending_skip_ = false;  // the next value is under an unknown top-level key
  int skip_ = 0;               // depth inside a skipped value
  std::vector<StoredPiece>* list_ = nullptr;
  std::string key_;
  StoredPiece piece_;
  int field_ = 0;  // the piece's fields read
  std::string error_;
};

// The safetensors headers of `files` in `dir`, in their order. They are one per server,
// MBs each for a model of many groups, so they are read and parsed in parallel: a thread
// per file up to the machine's threads, the calling thread reading whatever the others
// do not (all of them if no thread can be started).
std::vector<absl::StatusOr<SafetensorsHeader>> ReadShardHeaders(const std::string& dir,
                                                                const std::vector<std::string>& files) {
  std::vector<absl::StatusOr<SafetensorsHeader>> headers(files.size(), absl::UnknownError("not read"));
  std::atomic<size_t> next{0};
  auto read = [&] {
    for (size_t f = next++; f < files.size(); f = next++) {
      headers[f] = SafetensorsHeader::Read(absl::StrCat(dir, "/", files[f]));
    }
  };
  std::vector<std::thread> threads;
  const size_t count = std::min<size_t>(files.size(), std::max(1u, std::thread::hardware_concurrency()));
  try {
    for (size_t t = 1; t < count; ++t) threads.emplace_back(read);
  } catch (const std::system_error&) {  // out of threads: fewer readers
  }
  read();
  for (std::thread& thread : threads) thread.join();
  return headers;
}

}  // namespace

absl::StatusOr<std::string> ShardedIndexJson(const std::string& dir, const std::vector<std::string>& files) {
  const std::vector<absl::StatusOr<SafetensorsHeader>> headers = ReadShardHeaders(dir, files);
  std::map<std::string, std::vector<IndexedPiece>> pieces;
  std::vector<std::string> quoted_files;
  try {
    for (size_t f = 0; f < files.size(); ++f) {
      const std::string path = absl::StrCat(dir, "/", files[f]);
      FLATSHARD_RETURN_IF_ERROR(headers[f].status());
      const SafetensorsHeader& header = *headers[f];
      AppendQuoted(quoted_files.emplace_back(), files[f]);
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
      text += separator;
      AppendQuoted(text, key);
      text += ": [";
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
  IndexReader reader(index);
  Json::sax_parse(text, &reader);
  if (!reader.error().empty()) return absl::DataLossError(absl::StrCat("'", path, "' is ", reader.error()));
  return index;
}

}  // namespace flatshard::server
