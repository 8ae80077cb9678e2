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
  const absl::string_view json_text = bytes.substr(8);
  Json json;
  try {
    json = Json::parse(json_text);
  } catch (const Json::parse_error& error) {
    return bad(absl::StrCat("malformed JSON header: ", error.what()));
  }
  if (!json.is_object()) return bad("the header is not a JSON object");

  SafetensorsHeader header;
  header.bytes_.assign(header_size, '\0');  // only the size matters for a parsed header
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) return bad("__metadata__ is not an object");
      for (auto entry = it.value().begin(); entry != it.value().end(); ++entry) {
        if (!entry.value().is_string()) return bad(absl::StrCat("__metadata__['", entry.key(), "'] is not a string"));
        header.metadata_[entry.key()] = entry.value().get<std::string>();
      }
      continue;
    }
    const Json& entry = it.value();
    SafetensorsTensor t;
    t.name = it.key();
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
      return bad(absl::StrCat("tensor '", t.name, "' needs dtype, shape and data_offsets [begin, end]"));
    }
    absl::StatusOr<DType> dtype = ParseDType(entry["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(absl::StrCat("tensor '", t.name, "': ", dtype.status().message()));
    t.dtype = *dtype;
    for (const Json& dim : entry["shape"]) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0) return bad(absl::StrCat("tensor '", t.name, "': bad shape"));
      t.shape.push_back(dim.get<int64_t>());
    }
    for (const Json& offset : entry["data_offsets"]) {
      if (!offset.is_number_unsigned() && !(offset.is_number_integer() && offset.get<int64_t>() >= 0)) {
        return bad(absl::StrCat("tensor '", t.name, "': bad data_offsets"));
      }
    }
    t.begin = entry["data_offsets"][0].get<uint64_t>();
    t.end = entry["data_offsets"][1].get<uint64_t>();
    absl::StatusOr<int64_t> numel = ShapeNumel(t.shape, t.name);
    // The byte count must not wrap around: 2^61 float64 elements are not 0 bytes.
    if (!numel.ok() || static_cast<uint64_t>(*numel) > std::numeric_limits<uint64_t>::max() / DTypeSize(t.dtype) ||
        t.end < t.begin || t.end - t.begin != static_cast<uint64_t>(*numel) * DTypeSize(t.dtype)) {
      return bad(absl::StrCat("tensor '", t.name, "': data_offsets [", t.begin, ", ", t.end,
                              "] do not match its shape and dtype"));
    }
    header.tensors_.push_back(std::move(t));
  }
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
  if (header.file_size() != file_size) {
    return bad(absl::StrCat("the tensors need ", header.file_size(), " bytes but the file has ", file_size));
  }
  return header;
}

void SafetensorsHeader::Index() {
  by_name_.clear();
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const SafetensorsTensor* SafetensorsHeader::Find(absl::string_view name) const {
  const auto found = by_name_.find(name);
  return found == by_name_.end() ? nullptr : &tensors_[found->second];
}

}  // namespace flatshard
