#include "kernels/cpu/norm.h"
#include "kernels/cpu/multiversion.h"

#include <cmath>

namespace flatshard::kernels::cpu {
namespace {
// Independent partial sums let the compiler keep them in vector lanes without
// reassociating a single accumulator (which it may not do without -ffast-math).
constexpr size_t kLanes = 16;
}  // namespace

FLATSHARD_MULTIVERSION double SquaredNorm(absl::Span<const float> x) {
  const float* data = x.data();
  const size_t n = x.size();
  double partial[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) {
      const double value = data[i + lane];
      partial[lane] += value * value;
    }
  }
  for (; i < n; ++i) {
    const double value = data[i];
    partial[0] += value * value;
  }
  double sum = 0.0;
  for (double lane_sum : partial) sum += lane_sum;
  return sum;
}

FLATSHARD_MULTIVERSION float MaxAbs(absl::Span<const float> x) {
  float result = 0.0f;
  bool saw_nan = false;
  for (float value : x) {
    saw_nan |= std::isnan(value);
    const float magnitude = std::fabs(value);
    result = magnitude > result ? magnitude : result;
  }
  return saw_nan ? std::nanf("") : result;
}

}  // namespace flatshard::kernels::cpu
