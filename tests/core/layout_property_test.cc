// Property tests over thousands of random specs, against an element-by-element reference
// built independently of FlatLayout: walk the tensors, inserting alignment padding,
// and record who owns every flat index.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/flat_buffer.h"
#include "core/layout.h"

namespace flatshard {
namespace {

struct Owner {
  int tensor = -1;  // -1: padding
  int64_t index = 0;
};

struct RandomSpec {
  std::vector<TensorSpec> tensors;
  int64_t align = 0;
  int shards = 1;
};

RandomSpec MakeRandomSpec(std::mt19937& rng) {
  RandomSpec spec;
  const int count = std::uniform_int_distribution<int>(1, 6)(rng);
  for (int t = 0; t < count; ++t) {
    TensorSpec tensor{"t" + std::to_string(t), {}, DType::kFloat32};
    const int dims = std::uniform_int_distribution<int>(0, 3)(rng);
    for (int d = 0; d < dims; ++d) {
      // Zero-sized dimensions one time in eight.
      const int size = std::uniform_int_distribution<int>(0, 7)(rng) == 0
                           ? 0
                           : std::uniform_int_distribution<int>(1, 5)(rng);
      tensor.shape.push_back(size);
    }
    spec.tensors.push_back(std::move(tensor));
  }
  const int64_t aligns[] = {0, 0, 1, 2, 3, 4, 8};
  spec.align = aligns[std::uniform_int_distribution<int>(0, 6)(rng)];
  spec.shards = std::uniform_int_distribution<int>(1, 9)(rng);
  return spec;
}

std::vector<Owner> ReferenceOwners(const RandomSpec& spec) {
  std::vector<Owner> owners;
  for (size_t t = 0; t < spec.tensors.size(); ++t) {
    int64_t numel = 1;
    for (int64_t dim : spec.tensors[t].shape) numel *= dim;
    while (spec.align > 0 && owners.size() % spec.align != 0) owners.push_back(Owner{});
    for (int64_t k = 0; k < numel; ++k) owners.push_back(Owner{static_cast<int>(t), k});
  }
  return owners;
}

class LayoutPropertyTest : public ::testing::Test {
 protected:
  // A random layout and the owner of each of its padded_numel() elements (shard padding
  // included, as tensor -1).
  struct Trial {
    RandomSpec spec;
    FlatLayout layout;
    std::vector<Owner> owners;
  };
  Trial NextTrial() {
    RandomSpec spec = MakeRandomSpec(rng_);
    FlatLayout layout = FlatLayout::Create(spec.tensors, spec.align, spec.shards).value();
    std::vector<Owner> owners = ReferenceOwners(spec);
    owners.resize(layout.padded_numel());
    return {std::move(spec), std::move(layout), std::move(owners)};
  }

  std::mt19937 rng_{20261122};
};

TEST_F(LayoutPropertyTest, ShardInfosMatchElementReference) {
  for (int trial = 0; trial < 3000; ++trial) {
    const RandomSpec spec = MakeRandomSpec(rng_);
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(spec.tensors, spec.align, spec.shards);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const std::vector<Owner> owners = ReferenceOwners(spec);
    const int64_t unpadded = static_cast<int64_t>(owners.size());
    const int64_t shard = (unpadded + spec.shards - 1) / spec.shards;
    ASSERT_EQ(layout->unpadded_numel(), unpadded);
    ASSERT_EQ(layout->shard_numel(), shard);
    ASSERT_EQ(layout->padded_numel(), shard * spec.shards);

    for (int rank = 0; rank < spec.shards; ++rank) {
      const int64_t begin = std::min(rank * shard, unpadded);
      const int64_t end = std::min((rank + 1) * shard, unpadded);
      ASSERT_EQ(layout->shard_end(rank) - layout->shard_start(rank), std::max<int64_t>(0, end - begin));
      for (int t = 0; t < layout->num_tensors(); ++t) {
        ShardParamInfo expected;
        for (int64_t flat = begin; flat < end; ++flat) {
          if (owners[flat].tensor != t) continue;
          if (!expected.in_shard) {
            expected.in_shard = true;
            expected.offset_in_shard = flat - rank * shard;
            expected.intra_param_start_idx = owners[flat].index;
          }
          expected.intra_param_end_idx = owners[flat].index;
          ++expected.numel_in_shard;
        }
        ASSERT_EQ(layout->shard_param_info(rank, t), expected)
            << "trial " << trial << " rank " << rank << " tensor " << t;
      }
    }
  }
}

TEST_F(LayoutPropertyTest, EveryPaddedElementMapsExactlyOnce) {
  for (int trial = 0; trial < 3000; ++trial) {
    const auto [spec, layout_value, owners] = NextTrial();
    const FlatLayout* layout = &layout_value;
    std::vector<int> covered(owners.size(), 0);
    for (const TensorPiece& piece : layout->MapRange(0, layout->padded_numel())) {
      for (int64_t k = 0; k < piece.numel; ++k) {
        const int64_t flat = piece.flat_offset + k;
        ASSERT_EQ(owners[flat].tensor, piece.tensor_index);
        ASSERT_EQ(owners[flat].index, piece.intra_start + k);
        ASSERT_EQ(layout->FlatIndex(piece.tensor_index, piece.intra_start + k), flat);
        ++covered[flat];
      }
    }
    for (size_t flat = 0; flat < owners.size(); ++flat) {
      ASSERT_EQ(covered[flat], owners[flat].tensor >= 0 ? 1 : 0) << "trial " << trial;
    }
  }
}

// ShardPaddingRuns marks exactly the elements of each shard that no tensor owns, in
// ordered, merged runs.
TEST_F(LayoutPropertyTest, PaddingRunsAreExactlyTheUnownedElementsOfEachShard) {
  for (int trial = 0; trial < 3000; ++trial) {
    const auto [spec, layout_value, owners] = NextTrial();
    const FlatLayout* layout = &layout_value;
    for (int rank = 0; rank < spec.shards; ++rank) {
      const int64_t base = rank * layout->shard_numel();
      std::vector<bool> padding(layout->shard_numel(), false);
      int64_t previous_end = -1;
      for (const auto& [offset, count] : layout->ShardPaddingRuns(rank)) {
        ASSERT_GT(count, 0);
        ASSERT_GT(offset, previous_end) << "runs overlap, touch or are out of order";
        previous_end = offset + count;
        ASSERT_LE(previous_end, layout->shard_numel());
        for (int64_t k = offset; k < offset + count; ++k) padding[k] = true;
      }
      for (int64_t k = 0; k < layout->shard_numel(); ++k) {
        ASSERT_EQ(padding[k], owners[base + k].tensor < 0) << "trial " << trial << " rank " << rank << " k " << k;
      }
    }
  }
}

TEST_F(LayoutPropertyTest, RandomRangesRoundTrip) {
  for (int trial = 0; trial < 3000; ++trial) {
    const auto [spec, layout_value, owners] = NextTrial();
    const FlatLayout* layout = &layout_value;
    std::uniform_int_distribution<int64_t> pick(0, layout->padded_numel());
    int64_t begin = pick(rng_);
    int64_t end = pick(rng_);
    if (begin > end) std::swap(begin, end);
    int64_t mapped = 0;
    int64_t previous_end = begin;
    for (const TensorPiece& piece : layout->MapRange(begin, end)) {
      ASSERT_GE(piece.flat_offset, previous_end);  // in order, disjoint
      ASSERT_GT(piece.numel, 0);
      previous_end = piece.flat_offset + piece.numel;
      ASSERT_LE(previous_end, end);
      for (int64_t k = 0; k < piece.numel; ++k) {
        ASSERT_EQ(owners[piece.flat_offset + k].tensor, piece.tensor_index);
      }
      mapped += piece.numel;
    }
    int64_t owned = 0;
    for (int64_t flat = begin; flat < end; ++flat) owned += owners[flat].tensor >= 0;
    ASSERT_EQ(mapped, owned) << "trial " << trial;
  }
}

TEST_F(LayoutPropertyTest, FlattenShardsAndViewsRoundTrip) {
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (int trial = 0; trial < 3000; ++trial) {
    const RandomSpec spec = MakeRandomSpec(rng_);
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(spec.tensors, spec.align, spec.shards);
    ASSERT_TRUE(layout.ok());
    std::vector<std::vector<float>> tensors(layout->num_tensors());
    std::vector<absl::Span<const float>> views;
    for (int t = 0; t < layout->num_tensors(); ++t) {
      tensors[t].resize(layout->tensor_numel(t));
      for (float& x : tensors[t]) x = value(rng_);
      views.push_back(tensors[t]);
    }
    std::vector<float> flat(layout->padded_numel(), 99.0f);  // poisoned
    ASSERT_TRUE(Flatten<float>(*layout, views, absl::MakeSpan(flat)).ok());

    // Padding is zero, tensors read back unchanged.
    const std::vector<Owner> owners = ReferenceOwners(spec);
    for (size_t flat_index = 0; flat_index < flat.size(); ++flat_index) {
      if (flat_index >= owners.size() || owners[flat_index].tensor < 0) {
        ASSERT_EQ(flat[flat_index], 0.0f);
      }
    }
    for (int t = 0; t < layout->num_tensors(); ++t) {
      absl::Span<float> view = TensorView<float>(*layout, absl::MakeSpan(flat), t);
      ASSERT_TRUE(std::equal(view.begin(), view.end(), tensors[t].begin(), tensors[t].end()));
    }

    // The shards, concatenated, are the padded flat buffer.
    std::vector<float> concatenated;
    std::vector<float> shard(layout->shard_numel(), -7.0f);
    for (int rank = 0; rank < layout->num_shards(); ++rank) {
      ASSERT_TRUE(ExtractShard<float>(*layout, flat, rank, absl::MakeSpan(shard)).ok());
      concatenated.insert(concatenated.end(), shard.begin(), shard.end());
    }
    ASSERT_EQ(concatenated, flat) << "trial " << trial;
  }
}

}  // namespace
}  // namespace flatshard
