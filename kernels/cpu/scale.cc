#include "kernels/cpu/scale.h"
#include "kernels/cpu/multiversion.h"

namespace flatshard::kernels::cpu {

FLATSHARD_MULTIVERSION void Scale(absl::Span<float> x, float alpha) {
  float* data = x.data();
  for (size_t i = 0, n = x.size(); i < n; ++i) data[i] *= alpha;
}

}  // namespace flatshard::kernels::cpu
