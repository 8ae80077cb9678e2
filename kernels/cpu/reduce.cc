#include "kernels/cpu/reduce.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cpu/accumulate.h"
#include "kernels/cpu/cast.h"
#include "kernels/cpu/scale.h"

namespace flatshard::kernels::cpu {
namespace {

// 64 KiB of float32: the block of dst and one block of each contribution stay in L2.
constexpr size_t kBlock = 16 * 1024;

}  // namespace

absl::Status Reduce(absl::Span<const Contribution> contributions, absl::Span<float> dst,
                    float alpha) {
  if (contributions.empty()) return absl::InvalidArgumentError("nothing to reduce");
  for (const Contribution& c : contributions) {
    if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16 && c.dtype != DType::kFloat16) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot reduce ", DTypeName(c.dtype), " gradients"));
    }
  }
  for (size_t begin = 0; begin < dst.size(); begin += kBlock) {
    const absl::Span<float> block = dst.subspan(begin, std::min(kBlock, dst.size() - begin));
    const Contribution& first = contributions[0];
    FLATSHARD_RETURN_IF_ERROR(
        Cast(first.dtype, first.At(begin), DType::kFloat32, block.data(), block.size()));
    for (size_t w = 1; w < contributions.size(); ++w) {
      FLATSHARD_RETURN_IF_ERROR(
          Accumulate(contributions[w].dtype, contributions[w].At(begin), block));
    }
    if (alpha != 1.0f) Scale(block, alpha);
  }
  return absl::OkStatus();
}

}  // namespace flatshard::kernels::cpu
