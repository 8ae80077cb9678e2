#include "server/file_extents.h"

#include <xxhash.h>
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
// XXH3 with the widest vector unit the CPU has (AVX2: 2-3x the library's default SSE2
// code here), picked at run time; libxxhash builds the dispatcher in.
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <new>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flatshard::server {

uint64_t Xxh3(absl::Span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

struct Xxh3Stream::State {
  XXH3_state_t* xxh;
};

void Xxh3Stream::Free::operator()(State* state) const {
  XXH3_freeState(state->xxh);
  delete state;
}

Xxh3Stream::Xxh3Stream() : state_(new State{XXH3_createState()}) {
  if (state_->xxh == nullptr) throw std::bad_alloc();
  Reset();
}

void Xxh3Stream::Reset() { (void)XXH3_64bits_reset(state_->xxh); }

void Xxh3Stream::Update(absl::Span<const std::byte> bytes) {
  (void)XXH3_64bits_update(state_->xxh, bytes.data(), bytes.size());
}

uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(state_->xxh); }

nlohmann::json ExtentsToJson(const std::vector<FileExtent>& extents) {
  nlohmann::json json = nlohmann::json::array();
  for (const FileExtent& e : extents) json.push_back({e.offset, e.length, absl::StrFormat("%016x", e.xxh3)});
  return json;
}

absl::StatusOr<std::vector<FileExtent>> ExtentsFromJson(const nlohmann::json& json, const std::string& what) {
  auto bad = [&] { return absl::DataLossError(absl::StrCat(what, ": malformed extent list")); };
  if (!json.is_array()) return bad();
  std::vector<FileExtent> extents;
  extents.reserve(json.size());
  for (const nlohmann::json& e : json) {
    if (!e.is_array() || e.size() != 3 || !e[0].is_number_unsigned() || !e[1].is_number_unsigned() ||
        !e[2].is_string()) {
      return bad();
    }
    FileExtent extent{e[0].get<uint64_t>(), e[1].get<uint64_t>(), 0};
    const std::string hex = e[2].get<std::string>();
    if (extent.length == 0 || hex.size() != 16 || !absl::SimpleHexAtoi(hex, &extent.xxh3)) return bad();
    extents.push_back(extent);
  }
  return extents;
}

absl::Status SortAndCheckTiling(std::vector<FileExtent>& extents, uint64_t size, const std::string& what) {
  std::sort(extents.begin(), extents.end(), [](const FileExtent& a, const FileExtent& b) {
    return a.offset < b.offset || (a.offset == b.offset && a.length < b.length);
  });
  uint64_t covered = 0;
  for (const FileExtent& e : extents) {
    if (e.offset == covered && e.length > size - std::min(covered, size)) {  // no wrap past 2^64 below
      return absl::FailedPreconditionError(absl::StrCat(what, ": a write of ", e.length, " bytes at ", e.offset,
                                                        " ends past the end of the file (", size, " bytes)"));
    }
    if (e.offset != covered) {
      return absl::FailedPreconditionError(
          e.offset > covered
              ? absl::StrCat(what, ": bytes [", covered, ", ", e.offset, ") were written by no server")
              : absl::StrCat(what, ": bytes [", e.offset, ", ", covered, ") were written twice"));
    }
    covered += e.length;
  }
  if (covered != size) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the writes cover ", covered, " bytes of a file of ", size, " (bytes [", std::min(covered, size),
        ", ", std::max(covered, size), ") unaccounted for)"));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
