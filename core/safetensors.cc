#include "core/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "core/layout.h"
#include "core/status_macros.h"

namespace flatshard {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100 << 20;  // the safetensors library's own limit

// The header's JSON, entry by entry in the tensors' order: a JSON object built whole
// would look up each name among those before it (ordered_json), quadratic in the tensors
// of a model wrapped module by module.
std::string Serialize(const std::vector<SafetensorsTensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  if (!metadata.empty()) absl::StrAppend(&json, "\"__metadata__\":", Json(metadata).dump());
  for (const SafetensorsTensor& t : tensors) {
    absl::StrAppend(&json, json.size() > 1 ? "," : "", Json(t.name).dump(), ":{\"dtype\":\"",
                    SafetensorsDTypeName(t.dtype), "\",\"shape\":", Json(t.shape).dump(), ",\"data_offsets\":[",
                    t.begin, ",", t.end, "]}");
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  const uint64_t length = json.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  return bytes + json;
}

// The header's JSON read as it is parsed (nlohmann's SAX interface), straight into
// tensors and metadata: a DOM of a header of 100000 tensors cost more to build and free
// than everything else a load does with it. The first problem is kept and the rest of the
// text only parsed, so that malformed JSON is reported as such wherever it is; failed()
// and error() say whether and what.
class HeaderReader final : public nlohmann::json_sax<Json> {
 public:
  HeaderReader(std::vector<SafetensorsTensor>& tensors, std::map<std::string, std::string>& metadata)
      : tensors_(tensors), metadata_(metadata) {}

  bool failed() const { return !syntax_error_.empty() || !error_.empty(); }
  const std::string& error() const { return syntax_error_.empty() ? error_ : syntax_error_; }

  bool null() override { return failed() || Scalar(); }
  bool boolean(bool) override { return failed() || Scalar(); }
  bool number_integer(number_integer_t value) override {
    return failed() || (value < 0 ? Scalar() : Count(static_cast<uint64_t>(value)));
  }
  bool number_unsigned(number_unsigned_t value) override { return failed() || Count(value); }
  bool number_float(number_float_t, const string_t&) override { return failed() || Scalar(); }
  bool binary(binary_t&) override { return failed() || Scalar(); }

  bool string(string_t& value) override {
    if (failed() || skip_ > 0) return true;
    if (at_ == At::kMetadata) {
      metadata_[key_] = std::move(value);
      return true;
    }
    if (at_ == At::kTensor && field_ == Field::kDtype) {
      absl::StatusOr<DType> dtype = ParseDType(value);
      if (!dtype.ok()) return Fail(absl::StrCat("tensor '", tensor_.name, "': ", dtype.status().message()));
      tensor_.dtype = *dtype;
      has_dtype_ = true;
      return true;
    }
    return Scalar();
  }

  bool start_object(std::size_t) override {
    if (failed()) return true;
    if (skip_ > 0 || (at_ == At::kTensor && field_ == Field::kOther)) return Skip();
    switch (at_) {
      case At::kStart:
        at_ = At::kTop;
        return true;
      case At::kTop:
        if (key_ == "__metadata__") {
          at_ = At::kMetadata;
          return true;
        }
        at_ = At::kTensor;
        tensor_ = SafetensorsTensor();
        tensor_.name = key_;
        has_dtype_ = has_shape_ = false;
        offsets_ = 0;
        return true;
      default:
        return Scalar();
    }
  }

  bool key(string_t& key) override {
    if (failed() || skip_ > 0) return true;
    if (at_ == At::kTensor) {
      field_ = key == "dtype" ? Field::kDtype
               : key == "shape" ? Field::kShape
               : key == "data_offsets" ? Field::kOffsets
                                       : Field::kOther;
    } else {
      key_ = std::move(key);
    }
    return true;
  }

  bool end_object() override {
    if (failed()) return true;
    if (skip_ > 0) return Unskip();
    if (at_ == At::kMetadata) {
      at_ = At::kTop;
    } else if (at_ == At::kTensor) {
      if (!has_dtype_ || !has_shape_ || offsets_ != 2) return Fail(NeedsFields(tensor_.name));
      absl::StatusOr<int64_t> numel = ShapeNumel(tensor_.shape, tensor_.name);
      // The byte count must not wrap around: 2^61 float64 elements are not 0 bytes.
      const SafetensorsTensor& t = tensor_;
      if (!numel.ok() || static_cast<uint64_t>(*numel) > std::numeric_limits<uint64_t>::max() / DTypeSize(t.dtype) ||
          t.end < t.begin || t.end - t.begin != static_cast<uint64_t>(*numel) * DTypeSize(t.dtype)) {
        return Fail(absl::StrCat("tensor '", t.name, "': data_offsets [", t.begin, ", ", t.end,
                                 "] do not match its shape and dtype"));
      }
      tensors_.push_back(std::move(tensor_));
      at_ = At::kTop;
    } else {
      at_ = At::kEnd;
    }
    return true;
  }

  bool start_array(std::size_t) override {
    if (failed()) return true;
    if (skip_ > 0 || (at_ == At::kTensor && field_ == Field::kOther)) return Skip();
    if (at_ == At::kTensor && field_ == Field::kShape && !in_array_) {
      tensor_.shape.clear();
      has_shape_ = in_array_ = true;
      return true;
    }
    if (at_ == At::kTensor && field_ == Field::kOffsets && !in_array_) {
      offsets_ = 0;
      in_array_ = true;
      return true;
    }
    return Scalar();
  }

  bool end_array() override {
    if (failed()) return true;
    if (skip_ > 0) return Unskip();
    in_array_ = false;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& error) override {
    syntax_error_ = absl::StrCat("malformed JSON header: ", error.what());
    return false;
  }

 private:
  enum class At { kStart, kTop, kMetadata, kTensor, kEnd };
  enum class Field { kDtype, kShape, kOffsets, kOther };

  static std::string NeedsFields(const std::string& name) {
    return absl::StrCat("tensor '", name, "' needs dtype, shape and data_offsets [begin, end]");
  }
  bool Fail(std::string error) {
    error_ = std::move(error);
    return true;  // parse on: the text may be malformed further on
  }
  bool Skip() {
    ++skip_;
    return true;
  }
  bool Unskip() {
    --skip_;
    return true;
  }

  // A non-negative integer: a dimension or an offset where one belongs.
  bool Count(uint64_t value) {
    if (skip_ > 0) return true;
    if (at_ == At::kTensor && in_array_ && field_ == Field::kShape) {
      if (value > uint64_t{std::numeric_limits<int64_t>::max()}) return Scalar();
      tensor_.shape.push_back(static_cast<int64_t>(value));
      return true;
    }
    if (at_ == At::kTensor && in_array_ && field_ == Field::kOffsets) {
      if (offsets_ == 2) return Fail(NeedsFields(tensor_.name));
      (offsets_++ == 0 ? tensor_.begin : tensor_.end) = value;
      return true;
    }
    return Scalar();
  }

  // Any other value: fine in a field of a tensor nobody reads, wrong anywhere else.
  bool Scalar() {
    if (skip_ > 0 || (at_ == At::kTensor && field_ == Field::kOther && !in_array_)) return true;
    switch (at_) {
      case At::kStart:
        return Fail("the header is not a JSON object");
      case At::kTop:
        return Fail(key_ == "__metadata__" ? "__metadata__ is not an object" : NeedsFields(key_));
      case At::kMetadata:
        return Fail(absl::StrCat("__metadata__['", key_, "'] is not a string"));
      case At::kTensor:
        if (in_array_ && field_ == Field::kShape) return Fail(absl::StrCat("tensor '", tensor_.name, "': bad shape"));
        if (in_array_ && field_ == Field::kOffsets) {
          return Fail(absl::StrCat("tensor '", tensor_.name, "': bad data_offsets"));
        }
        return Fail(NeedsFields(tensor_.name));
      case At::kEnd:
        break;
    }
    return Fail("the header is not a JSON object");
  }

  std::vector<SafetensorsTensor>& tensors_;
  std::map<std::string, std::string>& metadata_;
  std::string error_;         // the first problem with the header's contents
  std::string syntax_error_;  // or with its JSON
  At at_ = At::kStart;
  std::string key_;  // the key at the top level or in __metadata__
  Field field_ = Field::kOther;
  SafetensorsTensor tensor_;
  bool has_dtype_ = false, has_shape_ = false, in_array_ = false;
  int offsets_ = 0;  // data_offsets read
  int skip_ = 0;     // depth inside a value nobody reads
};

}  // namespace

absl::StatusOr<SafetensorsHeader> SafetensorsHeader::Build(
    std::vector<SafetensorsTensor> tensors, std::map<std::string, std::string> metadata) {
  std::set<std::string> names;
  uint64_t offset = 0;
  for (SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor name '", t.name, "' is empty, reserved or repeated"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t numel, ShapeNumel(t.shape, t.name));
    t.begin = offset;
    t.end = offset + static_cast<uint64_t>(numel) * DTypeSize(t.dtype);
    offset = t.end;
  }
  SafetensorsHeader header;
  header.bytes_ = Serialize(tensors, metadata);
  header.data_size_ = offset;
  header.tensors_ = std::move(tensors);
  header.metadata_ = std::move(metadata);
  header.Index();
  return header;
}

absl::StatusOr<SafetensorsHeader> SafetensorsHeader::Read(const std::string& path) {
  FLATSHARD_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  FLATSHARD_ASSIGN_OR_RETURN(const uint64_t file_size, file.Size());
  if (file_size < 8) {
    return absl::DataLossError(absl::StrCat("safetensors file '", path, "': shorter than the 8-byte header length"));
  }
  std::string prefix(8, '\0');
  FLATSHARD_RETURN_IF_ERROR(file.ReadAt(0, absl::MakeSpan(reinterpret_cast<std::byte*>(prefix.data()), 8)));
  FLATSHARD_ASSIGN_OR_RETURN(const uint64_t header_size, HeaderSize(prefix, file_size, path));
  std::string bytes(header_size, '\0');
  FLATSHARD_RETURN_IF_ERROR(file.ReadAt(0, absl::MakeSpan(reinterpret_cast<std::byte*>(bytes.data()), header_size)));
  return Parse(bytes, file_size, path);
}

absl::StatusOr<uint64_t> SafetensorsHeader::HeaderSize(absl::string_view prefix, uint64_t file_size,
                                                       const std::string& path) {
  if (file_size < 8 || prefix.size() < 8) {
    return absl::DataLossError(absl::StrCat("safetensors file '", path, "': shorter than the 8-byte header length"));
  }
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(prefix[i]);
  if (length > kMaxHeaderBytes || 8 + length > file_size) {
    return absl::DataLossError(absl::StrCat("safetensors file '", path, "': header length ", length,
                                            " does not fit in the file of ", file_size, " bytes"));
  }
  return 8 + length;
}

absl::StatusOr<SafetensorsHeader> SafetensorsHeader::Parse(absl::string_view bytes, uint64_t file_size,
                                                           const std::string& path) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("safetensors file '", path, "': ", what));
  };
  FLATSHARD_ASSIGN_OR_RETURN(const uint64_t header_size, HeaderSize(bytes, file_size, path));
  if (bytes.size() != header_size) return bad("the header bytes given do not match the header length");
  SafetensorsHeader header;
  HeaderReader reader(header.tensors_, header.metadata_);
  (void)Json::sax_parse(bytes.substr(8), &reader);
  if (reader.failed()) return bad(reader.error());
  header.bytes_.assign(header_size, '\0');  // only the size matters for a parsed header
  // In the order of their bytes, which must cover the data exactly: no overlap, no hole,
  // nothing past the end.
  std::sort(header.tensors_.begin(), header.tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  uint64_t cursor = 0;
  for (const SafetensorsTensor& t : header.tensors_) {
    if (t.begin != cursor) return bad(absl::StrCat("tensor '", t.name, "' leaves a hole or overlaps at byte ", cursor));
    cursor = t.end;
  }
  header.data_size_ = cursor;
  header.Index();
  if (header.by_name_.size() != header.tensors_.size()) {
    for (size_t i = 0; i < header.tensors_.size(); ++i) {
      if (header.by_name_.at(header.tensors_[i].name) != i) {
        return bad(absl::StrCat("tensor '", header.tensors_[i].name, "' is listed twice"));
      }
    }
  }
  if (header.file_size() != file_size) {
    return bad(absl::StrCat("the tensors need ", header.file_size(), " bytes but the file has ", file_size));
  }
  return header;
}

void SafetensorsHeader::Index() {
  by_name_.clear();
  by_name_.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const SafetensorsTensor* SafetensorsHeader::Find(absl::string_view name) const {
  const auto found = by_name_.find(name);
  return found == by_name_.end() ? nullptr : &tensors_[found->second];
}

}  // namespace flatshard
