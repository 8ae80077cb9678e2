// Fused single-pass SGD and Adam/AdamW on the GPU, using the CPU kernels' element code
// (kernels/optimizer_math.h).
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/launch.h"

namespace flatshard::kernels::cuda::internal {
namespace {

struct AdamBody {
  AdamScalars s;
  float* p;
  const float* g;
  float* m;
  float* v;
  float* v_max;  // amsgrad only

  __device__ void Vector(int64_t i) const {
    float4 p4 = reinterpret_cast<float4*>(p)[i];
    const float4 g4 = reinterpret_cast<const float4*>(g)[i];
    float4 m4 = reinterpret_cast<float4*>(m)[i];
    float4 v4 = reinterpret_cast<float4*>(v)[i];
    float4 vm4 = s.amsgrad ? reinterpret_cast<float4*>(v_max)[i] : float4{};
    AdamElement(s, p4.x, g4.x, m4.x, v4.x, vm4.x);
    AdamElement(s, p4.y, g4.y, m4.y, v4.y, vm4.y);
    AdamElement(s, p4.z, g4.z, m4.z, v4.z, vm4.z);
    AdamElement(s, p4.w, g4.w, m4.w, v4.w, vm4.w);
    reinterpret_cast<float4*>(p)[i] = p4;
    reinterpret_cast<float4*>(m)[i] = m4;
    reinterpret_cast<float4*>(v)[i] = v4;
    if (s.amsgrad) reinterpret_cast<float4*>(v_max)[i] = vm4;
  }
  __device__ void Scalar(int64_t i) const {
    float unused = 0.0f;
    AdamElement(s, p[i], g[i], m[i], v[i], s.amsgrad ? v_max[i] : unused);
  }
};

struct SgdBody {
  SgdHyperparams hp;
  bool first_step;
  float* p;
  const float* g;
  float* buf;  // momentum != 0 only

  __device__ void Vector(int64_t i) const {
    const bool momentum = hp.momentum != 0.0f;
    float4 p4 = reinterpret_cast<float4*>(p)[i];
    const float4 g4 = reinterpret_cast<const float4*>(g)[i];
    float4 b4 = momentum && !first_step ? reinterpret_cast<float4*>(buf)[i] : float4{};
    SgdElement(hp, first_step, p4.x, g4.x, b4.x);
    SgdElement(hp, first_step, p4.y, g4.y, b4.y);
    SgdElement(hp, first_step, p4.z, g4.z, b4.z);
    SgdElement(hp, first_step, p4.w, g4.w, b4.w);
    reinterpret_cast<float4*>(p)[i] = p4;
    if (momentum) reinterpret_cast<float4*>(buf)[i] = b4;
  }
  __device__ void Scalar(int64_t i) const {
    float unused = 0.0f;
    SgdElement(hp, first_step, p[i], g[i], hp.momentum != 0.0f ? buf[i] : unused);
  }
};

}  // namespace

cudaError_t LaunchSgd(const SgdHyperparams& hp, bool first_step, float* p, const float* g,
                      float* buf, int64_t n, cudaStream_t stream) {
  const bool vec = Aligned(p, 16) && Aligned(g, 16) && (hp.momentum == 0.0f || Aligned(buf, 16));
  return Launch(SgdBody{hp, first_step, p, g, buf}, n, vec, stream);
}

cudaError_t LaunchAdam(const AdamScalars& s, float* p, const float* g, float* m, float* v,
                       float* v_max, int64_t n, cudaStream_t stream) {
  const bool vec = Aligned(p, 16) && Aligned(g, 16) && Aligned(m, 16) && Aligned(v, 16) &&
                   (!s.amsgrad || Aligned(v_max, 16));
  return Launch(AdamBody{s, p, g, m, v, v_max}, n, vec, stream);
}

}  // namespace flatshard::kernels::cuda::internal
