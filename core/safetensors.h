// The safetensors format (8-byte little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets} plus an optional "__metadata__" map of
// strings, padded with spaces to a multiple of 8, then the tensors' bytes, contiguous, in
// header order). SafetensorsHeader builds a header for known tensors, so several writers
// can each fill their own byte ranges of one file, and parses and validates the header of
// an existing file. Immutable after construction; thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto header, SafetensorsHeader::Build(entries, metadata));
//   file.WriteAt(0, header.bytes());  file.WriteAt(header.data_start() + t.begin, data);
#ifndef FLATSHARD_CORE_SAFETENSORS_H_
#define FLATSHARD_CORE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace flatshard {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to data_start(), [begin, end)
  uint64_t end = 0;
};

class SafetensorsHeader {
 public:
  // Lays the tensors out contiguously in the given order. InvalidArgument for an empty
  // or duplicate name, a negative dimension or the reserved name "__metadata__".
  [[nodiscard]] static absl::StatusOr<SafetensorsHeader> Build(
      std::vector<SafetensorsTensor> tensors, std::map<std::string, std::string> metadata);

  // Reads and validates the header of `path`: DataLoss naming the file and the problem
  // for a truncated file, malformed JSON, an unknown dtype, offsets that do not match the
  // shape, overlap, leave holes or run past the end of the file.
  [[nodiscard]] static absl::StatusOr<SafetensorsHeader> Read(const std::string& path);
  // The same checks on a header already read: `bytes` = the first HeaderSize() bytes of
  // the file `path` of `file_size` bytes.
  [[nodiscard]] static absl::StatusOr<SafetensorsHeader> Parse(absl::string_view bytes, uint64_t file_size,
                                                               const std::string& path);
  // 8 + the header length that the file's first 8 bytes (`prefix`) give; DataLoss if it
  // does not fit in `file_size`.
  [[nodiscard]] static absl::StatusOr<uint64_t> HeaderSize(absl::string_view prefix, uint64_t file_size,
                                                           const std::string& path);

  // 8-byte length + JSON, padded: what goes at offset 0 of the file.
  absl::Span<const std::byte> bytes() const {
    return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bytes_.data()), bytes_.size());
  }
  uint64_t data_start() const { return bytes_.size(); }
  uint64_t file_size() const { return data_start() + data_size_; }
  // Built: in the order given; read: in the order of their bytes in the file.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor named `name`, or nullptr; O(1).
  const SafetensorsTensor* Find(absl::string_view name) const;

 private:
  void Index();  // fills by_name_ from tensors_

  std::string bytes_;
  uint64_t data_size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> by_name_;  // index into tensors_
  std::map<std::string, std::string> metadata_;
};

}  // namespace flatshard

#endif  // FLATSHARD_CORE_SAFETENSORS_H_
