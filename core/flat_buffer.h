// Moves tensor elements between named tensors, a flat parameter and its shards, for any
// element type T, following a FlatLayout. Header-only templates; pure functions over
// caller-owned buffers, thread-safe as long as callers do not share output buffers.
//
//   std::vector<float> flat(layout.padded_numel());
//   FLATSHARD_RETURN_IF_ERROR(Flatten<float>(layout, {w, b}, absl::MakeSpan(flat)));
//   absl::Span<float> w_view = TensorView<float>(layout, absl::MakeSpan(flat), 0);
#ifndef FLATSHARD_CORE_FLAT_BUFFER_H_
#define FLATSHARD_CORE_FLAT_BUFFER_H_

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/layout.h"

namespace flatshard {

// Writes `tensors` (one per layout tensor, in order, each with exactly its numel) into
// `flat` and zeroes every padding element. `flat` must hold at least unpadded_numel();
// elements past it are zeroed too. Returns InvalidArgument on a count or size mismatch,
// leaving `flat` untouched.
template <typename T>
[[nodiscard]] absl::Status Flatten(const FlatLayout& layout,
                                   absl::Span<const absl::Span<const T>> tensors,
                                   absl::Span<T> flat) {
  if (static_cast<int>(tensors.size()) != layout.num_tensors()) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", layout.num_tensors(),
                                                   " tensors, got ", tensors.size()));
  }
  if (static_cast<int64_t>(flat.size()) < layout.unpadded_numel()) {
    return absl::InvalidArgumentError(absl::StrCat("flat buffer holds ", flat.size(),
                                                   " elements, needs ",
                                                   layout.unpadded_numel()));
  }
  for (int i = 0; i < layout.num_tensors(); ++i) {
    if (static_cast<int64_t>(tensors[i].size()) != layout.tensor_numel(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", layout.tensor(i).fqn, "' has ", tensors[i].size(),
                       " elements, expected ", layout.tensor_numel(i)));
    }
  }
  int64_t cursor = 0;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const int64_t offset = layout.tensor_offset(i);
    std::fill(flat.begin() + cursor, flat.begin() + offset, T{});
    std::copy(tensors[i].begin(), tensors[i].end(), flat.begin() + offset);
    cursor = offset + layout.tensor_numel(i);
  }
  std::fill(flat.begin() + cursor, flat.end(), T{});
  return absl::OkStatus();
}

// The elements of tensor `index` inside `flat` (a view; no copy).
// Precondition: flat.size() >= unpadded_numel(), 0 <= index < num_tensors().
template <typename T>
absl::Span<T> TensorView(const FlatLayout& layout, absl::Span<T> flat, int index) {
  return flat.subspan(layout.tensor_offset(index), layout.tensor_numel(index));
}

// Copies shard `rank` of `flat` into `shard` (shard_numel() elements), zero-filling its
// right padding. Returns InvalidArgument if `flat` is shorter than unpadded_numel() or
// `shard` is not exactly shard_numel() long.
template <typename T>
[[nodiscard]] absl::Status ExtractShard(const FlatLayout& layout, absl::Span<const T> flat,
                                        int rank, absl::Span<T> shard) {
  if (rank < 0 || rank >= layout.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("shard rank ", rank, " out of range [0, ",
                                                   layout.num_shards(), ")"));
  }
  if (static_cast<int64_t>(flat.size()) < layout.unpadded_numel() ||
      static_cast<int64_t>(shard.size()) != layout.shard_numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flat buffer of ", flat.size(), " and shard of ", shard.size(), " elements; need >= ",
        layout.unpadded_numel(), " and exactly ", layout.shard_numel()));
  }
  const int64_t start = layout.shard_start(rank);
  const int64_t end = layout.shard_end(rank);
  std::copy(flat.begin() + start, flat.begin() + end, shard.begin());
  std::fill(shard.begin() + (end - start), shard.end(), T{});
  return absl::OkStatus();
}

}  // namespace flatshard

#endif  // FLATSHARD_CORE_FLAT_BUFFER_H_
