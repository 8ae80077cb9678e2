#include "kernels/cpu/scale.h"

namespace flatshard::kernels::cpu {

void Scale(absl::Span<float> x, float alpha) {
  float* data = x.data();
  for (size_t i = 0, n = x.size(); i < n; ++i) data[i] *= alpha;
}

}  // namespace flatshard::kernels::cpu
