// FlatLayout: where each named tensor of a group lives in its flat parameter and in each
// of the N shards, following PyTorch FSDP's FlatParamHandle bit for bit (DESIGN.md, "Flat
// layout: the exact rules").
//
//  - Tensors are laid out in registration order; before each one, zero padding brings the
//    running offset up to a multiple of `align` (elements; 0 = no alignment).
//  - U = unpadded_numel() counts that alignment padding; S = shard_numel() = ceil(U / N);
//    shard i covers the flat range [i*S, max(i*S, min((i+1)*S, U))) and is right-padded
//    with zeros to S elements, so padded_numel() = N*S.
//  - A zero-element tensor lies in no shard; a 0-dim tensor has one element.
//
// A FlatLayout is immutable after Create() and safe to share between threads.
//
//   FLATSHARD_ASSIGN_OR_RETURN(FlatLayout layout,
//                              FlatLayout::Create({{"w", {4, 3}, DType::kFloat32}}, 0, 3));
//   ShardParamInfo info = layout.shard_param_info(/*rank=*/1, /*tensor=*/0);
#ifndef FLATSHARD_CORE_LAYOUT_H_
#define FLATSHARD_CORE_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace flatshard {

// One named tensor of a group, as registered.
struct TensorSpec {
  std::string fqn;
  std::vector<int64_t> shape;  // empty: a 0-dim tensor with one element
  DType dtype = DType::kFloat32;

  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// FSDP's _ShardParamInfo for one (shard, tensor) pair. When in_shard is false the other
// fields are 0 (FSDP leaves them None). intra_param_end_idx is inclusive.
struct ShardParamInfo {
  bool in_shard = false;
  int64_t offset_in_shard = 0;
  int64_t numel_in_shard = 0;
  int64_t intra_param_start_idx = 0;
  int64_t intra_param_end_idx = 0;

  friend bool operator==(const ShardParamInfo&, const ShardParamInfo&) = default;
};

// FSDP's FlatParamShardMetadata: the tensors a shard touches, in order, with the
// inclusive [start, end] element range of each that the shard holds.
struct ShardMetadata {
  std::vector<std::string> fqns;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> numels;
  std::vector<std::pair<int64_t, int64_t>> offsets;
};

// A contiguous run of one tensor's elements inside the flat buffer:
// flat[flat_offset + k] == tensor[tensor_index].flatten()[intra_start + k], k < numel.
struct TensorPiece {
  int tensor_index = 0;
  int64_t intra_start = 0;
  int64_t numel = 0;
  int64_t flat_offset = 0;

  friend bool operator==(const TensorPiece&, const TensorPiece&) = default;
};

class FlatLayout {
 public:
  // Validates the spec and computes the layout. Returns InvalidArgument naming the
  // offending field for: an empty tensor list, an empty or duplicate fqn, a negative
  // dimension, a dtype a flat parameter cannot hold, a numel that overflows int64,
  // align < 0, or num_shards < 1.
  [[nodiscard]] static absl::StatusOr<FlatLayout> Create(std::vector<TensorSpec> tensors,
                                                         int64_t align, int num_shards);

  int num_tensors() const { return static_cast<int>(tensors_.size()); }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const TensorSpec& tensor(int index) const { return tensors_[index]; }
  int64_t tensor_offset(int index) const { return offsets_[index]; }
  int64_t tensor_numel(int index) const { return numels_[index]; }
  // Index of the tensor named `fqn`, or nullopt.
  std::optional<int> FindTensor(absl::string_view fqn) const;

  int64_t align() const { return align_; }
  int num_shards() const { return num_shards_; }
  int64_t unpadded_numel() const { return unpadded_numel_; }        // U
  int64_t shard_numel() const { return shard_numel_; }              // S
  int64_t padded_numel() const { return shard_numel_ * num_shards_; }  // N*S

  // The unpadded flat range [shard_start, shard_end) of shard `rank` and the zeros
  // appended to it. Precondition: 0 <= rank < num_shards().
  int64_t shard_start(int rank) const;
  int64_t shard_end(int rank) const;
  int64_t shard_padding(int rank) const { return shard_numel_ - (shard_end(rank) - shard_start(rank)); }

  // Preconditions: 0 <= rank < num_shards(), 0 <= tensor_index < num_tensors().
  ShardParamInfo shard_param_info(int rank, int tensor_index) const;
  std::vector<ShardParamInfo> shard_param_infos(int rank) const;
  ShardMetadata shard_metadata(int rank) const;

  // The tensor pieces covering the flat range [begin, end), in order, skipping alignment
  // and shard padding. Precondition: 0 <= begin <= end <= padded_numel().
  std::vector<TensorPiece> MapRange(int64_t begin, int64_t end) const;
  // The padding of shard `rank` (alignment gaps and the zeros appended to the shard) as
  // runs {offset in the shard, count}, in order, adjacent runs merged; with the pieces
  // MapRange gives for the shard's range they tile [0, shard_numel()).
  // Precondition: 0 <= rank < num_shards().
  std::vector<std::pair<int64_t, int64_t>> ShardPaddingRuns(int rank) const;
  // Flat index of element `intra_index` of tensor `tensor_index` (the inverse of
  // MapRange). Precondition: 0 <= intra_index < tensor_numel(tensor_index).
  int64_t FlatIndex(int tensor_index, int64_t intra_index) const {
    return offsets_[tensor_index] + intra_index;
  }

  // Same tensors, align and shard count.
  friend bool operator==(const FlatLayout& a, const FlatLayout& b) {
    return a.tensors_ == b.tensors_ && a.align_ == b.align_ && a.num_shards_ == b.num_shards_;
  }

 private:
  FlatLayout() = default;

  std::vector<TensorSpec> tensors_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> numels_;
  int64_t align_ = 0;
  int num_shards_ = 1;
  int64_t unpadded_numel_ = 0;
  int64_t shard_numel_ = 0;
};

// Product of `shape` (1 for a 0-dim shape), or InvalidArgument if a dimension is
// negative or the product overflows int64. `what` names the tensor in the message.
[[nodiscard]] absl::StatusOr<int64_t> ShapeNumel(const std::vector<int64_t>& shape,
                                                 absl::string_view what);

// A hybrid-sharded job's split of one shard of `shard_numel` elements into `replicas`
// chunks, chunk q being the one replica group q reduces: {offset, numel} of chunk
// `replica`. Balanced, with each boundary rounded down to 4 elements (16 bytes) for the
// kernels' vector loads: chunks differ by up to 4 elements (more than the balance), and
// small shards may leave a chunk empty.
std::pair<int64_t, int64_t> ReplicaChunk(int64_t shard_numel, int replicas, int replica);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_LAYOUT_H_
