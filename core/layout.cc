#include "core/layout.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard {
namespace {

constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

absl::Status CheckedAdd(int64_t a, int64_t b, int64_t& sum, absl::string_view what) {
  if (a > kMaxInt64 - b) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the flat parameter's numel overflows int64"));
  }
  sum = a + b;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ShapeNumel(const std::vector<int64_t>& shape, absl::string_view what) {
  int64_t numel = 1;
  for (size_t dim = 0; dim < shape.size(); ++dim) {
    if (shape[dim] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": dimension ", dim, " is ",
                                                     shape[dim], ", must be >= 0"));
    }
    if (shape[dim] != 0 && numel > kMaxInt64 / shape[dim]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": numel overflows int64"));
    }
    numel *= shape[dim];
  }
  return numel;
}

absl::StatusOr<FlatLayout> FlatLayout::Create(std::vector<TensorSpec> tensors, int64_t align,
                                              int num_shards) {
  if (tensors.empty()) return absl::InvalidArgumentError("tensors: the list is empty");
  if (align < 0) {
    return absl::InvalidArgumentError(absl::StrCat("align: ", align, ", must be >= 0"));
  }
  if (num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("servers: ", num_shards, ", must be >= 1"));
  }
  FlatLayout layout;
  layout.align_ = align;
  layout.num_shards_ = num_shards;
  layout.offsets_.reserve(tensors.size());
  layout.numels_.reserve(tensors.size());

  std::unordered_set<std::string> seen;
  int64_t running = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& spec = tensors[i];
    const std::string what = absl::StrCat("tensors[", i, "] '", spec.fqn, "'");
    if (spec.fqn.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tensors[", i, "]: empty name"));
    }
    if (!seen.insert(spec.fqn).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": duplicate name"));
    }
    if (!IsFloatingParamDType(spec.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", DTypeName(spec.dtype),
                       " cannot be a flat parameter (float32, bfloat16 or float16)"));
    }
    FLATSHARD_ASSIGN_OR_RETURN(const int64_t numel, ShapeNumel(spec.shape, what));
    if (align > 0 && running % align != 0) {
      FLATSHARD_RETURN_IF_ERROR(CheckedAdd(running, align - running % align, running, what));
    }
    layout.offsets_.push_back(running);
    layout.numels_.push_back(numel);
    FLATSHARD_RETURN_IF_ERROR(CheckedAdd(running, numel, running, what));
  }
  layout.tensors_ = std::move(tensors);
  layout.unpadded_numel_ = running;
  // ceil(U / N) without overflow; N*S must fit too.
  layout.shard_numel_ = running / num_shards + (running % num_shards != 0 ? 1 : 0);
  if (layout.shard_numel_ > kMaxInt64 / num_shards) {
    return absl::InvalidArgumentError("tensors: the padded flat parameter overflows int64");
  }
  return layout;
}

std::optional<int> FlatLayout::FindTensor(absl::string_view fqn) const {
  for (int i = 0; i < num_tensors(); ++i) {
    if (tensors_[i].fqn == fqn) return i;
  }
  return std::nullopt;
}

int64_t FlatLayout::shard_start(int rank) const { return rank * shard_numel_; }

int64_t FlatLayout::shard_end(int rank) const {
  const int64_t start = shard_start(rank);
  return std::max(start, std::min(start + shard_numel_, unpadded_numel_));
}

ShardParamInfo FlatLayout::shard_param_info(int rank, int tensor_index) const {
  const int64_t numel = numels_[tensor_index];
  const int64_t start = shard_start(rank);
  const int64_t end = shard_end(rank);  // exclusive
  const int64_t param_start = offsets_[tensor_index];
  const int64_t param_end = param_start + numel;  // exclusive
  if (numel == 0 || start >= param_end || end <= param_start) return ShardParamInfo{};
  ShardParamInfo info;
  info.in_shard = true;
  if (param_start <= start) {
    info.intra_param_start_idx = start - param_start;
    info.offset_in_shard = 0;
  } else {
    info.intra_param_start_idx = 0;
    info.offset_in_shard = param_start - start;
  }
  info.intra_param_end_idx = std::min(param_end, end) - 1 - param_start;
  info.numel_in_shard = info.intra_param_end_idx - info.intra_param_start_idx + 1;
  return info;
}

std::vector<ShardParamInfo> FlatLayout::shard_param_infos(int rank) const {
  std::vector<ShardParamInfo> infos;
  infos.reserve(tensors_.size());
  for (int i = 0; i < num_tensors(); ++i) infos.push_back(shard_param_info(rank, i));
  return infos;
}

ShardMetadata FlatLayout::shard_metadata(int rank) const {
  ShardMetadata metadata;
  for (int i = 0; i < num_tensors(); ++i) {
    const ShardParamInfo info = shard_param_info(rank, i);
    if (!info.in_shard) continue;
    metadata.fqns.push_back(tensors_[i].fqn);
    metadata.shapes.push_back(tensors_[i].shape);
    metadata.numels.push_back(numels_[i]);
    metadata.offsets.emplace_back(info.intra_param_start_idx, info.intra_param_end_idx);
  }
  return metadata;
}

std::vector<TensorPiece> FlatLayout::MapRange(int64_t begin, int64_t end) const {
  std::vector<TensorPiece> pieces;
  // First tensor that ends after `begin` (tensor ends are non-decreasing).
  int first = 0;
  for (int hi = num_tensors(); first < hi;) {
    const int mid = first + (hi - first) / 2;
    if (offsets_[mid] + numels_[mid] <= begin) {
      first = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (int i = first; i < num_tensors() && offsets_[i] < end; ++i) {
    const int64_t lo = std::max(begin, offsets_[i]);
    const int64_t hi = std::min(end, offsets_[i] + numels_[i]);
    if (lo >= hi) continue;  // zero-element tensor
    pieces.push_back(TensorPiece{i, lo - offsets_[i], hi - lo, lo});
  }
  return pieces;
}

std::vector<std::pair<int64_t, int64_t>> FlatLayout::ShardPaddingRuns(int rank) const {
  const int64_t base = rank * shard_numel_;
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t covered = 0;  // shard offset up to which elements are accounted for
  auto pad_to = [&](int64_t offset) {
    if (offset <= covered) return;
    runs.emplace_back(covered, offset - covered);
    covered = offset;
  };
  for (const TensorPiece& piece : MapRange(base, base + shard_numel_)) {
    pad_to(piece.flat_offset - base);
    covered = piece.flat_offset - base + piece.numel;
  }
  pad_to(shard_numel_);
  return runs;
}

std::pair<int64_t, int64_t> ReplicaChunk(int64_t shard_numel, int replicas, int replica) {
  replicas = std::max(1, replicas);
  auto boundary = [&](int64_t q) { return q >= replicas ? shard_numel : shard_numel * q / replicas / 4 * 4; };
  return {boundary(replica), boundary(replica + 1) - boundary(replica)};
}

}  // namespace flatshard
