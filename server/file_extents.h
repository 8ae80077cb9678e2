// FileExtent: a byte range of a checkpoint file and the XXH3-64 of its bytes. A save
// records an extent per run of contiguous writes as it writes (DirectorySink, at most
// DirectorySink::kMaxExtentBytes each; Xxh3Stream hashes a run), the manifest lists every
// file's extents, and a load verifies each extent it reads (CheckpointReader): every byte
// is checked in the pass that reads it, and nothing is re-read to compute checksums.
// Plain values and pure functions, thread-safe (Xxh3Stream: one object per thread).
//
// Manifest form, per file: "extents": [[offset, length, "<16 hex digits>"], ...], sorted,
// tiling [0, bytes) with neither gaps nor overlaps.
#ifndef FLATSHARD_SERVER_FILE_EXTENTS_H_
#define FLATSHARD_SERVER_FILE_EXTENTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace flatshard::server {

struct FileExtent {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t xxh3 = 0;
};

// XXH3-64 of `bytes`.
uint64_t Xxh3(absl::Span<const std::byte> bytes);

// XXH3-64 of bytes given piece by piece: after Reset and Updates with pieces p1..pn,
// Digest() == Xxh3(p1 + ... + pn), and more pieces may follow. Not thread-safe; movable.
class Xxh3Stream {
 public:
  Xxh3Stream();
  void Reset();
  void Update(absl::Span<const std::byte> bytes);
  uint64_t Digest() const;

 private:
  struct State;
  struct Free {
    void operator()(State* state) const;
  };
  std::unique_ptr<State, Free> state_;
};

nlohmann::json ExtentsToJson(const std::vector<FileExtent>& extents);
// DataLoss naming `what` for malformed JSON.
[[nodiscard]] absl::StatusOr<std::vector<FileExtent>> ExtentsFromJson(const nlohmann::json& json,
                                                                      const std::string& what);

// Sorts `extents` and checks that they tile [0, size) exactly. FailedPrecondition naming
// `what` and the first gap or overlap (bytes no server wrote, or wrote twice).
[[nodiscard]] absl::Status SortAndCheckTiling(std::vector<FileExtent>& extents, uint64_t size,
                                              const std::string& what);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_FILE_EXTENTS_H_
