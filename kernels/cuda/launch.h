// Internal to kernels/cuda: the launchers that the .cu files define and kernels.cc wraps.
// They take validated arguments, enqueue on `stream` and return the launch error.
// Kept free of Abseil so that nvcc compiles only CUDA and the standard library.
#ifndef FLATSHARD_KERNELS_CUDA_LAUNCH_H_
#define FLATSHARD_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/optimizer_math.h"

namespace flatshard::kernels::cuda::internal {

enum class HalfKind { kBFloat16, kFloat16 };

cudaError_t LaunchCastToHalf(HalfKind kind, const float* src, uint16_t* dst, int64_t n,
                             cudaStream_t stream);
cudaError_t LaunchCastFromHalf(HalfKind kind, const uint16_t* src, float* dst, int64_t n,
                               cudaStream_t stream);
cudaError_t LaunchAccumulateFloat32(const float* src, float* dst, int64_t n, cudaStream_t stream);
cudaError_t LaunchAccumulateHalf(HalfKind kind, const uint16_t* src, float* dst, int64_t n,
                                 cudaStream_t stream);
cudaError_t LaunchScale(float* x, int64_t n, float alpha, cudaStream_t stream);

// Up to kMaxReduceSources contributions for one reduce launch.
enum class SourceKind : uint8_t { kFloat32, kBFloat16, kFloat16 };
inline constexpr int kMaxReduceSources = 8;
struct ReduceSources {
  const void* data[kMaxReduceSources] = {};
  SourceKind kind[kMaxReduceSources] = {};
  int count = 0;
};
// dst[i] = ((accumulate ? dst[i] + s0[i] : s0[i]) + s1[i]) + ... in source order, then
// *= alpha when `scale`.
cudaError_t LaunchReduce(const ReduceSources& sources, bool accumulate, bool scale, float alpha,
                         float* dst, int64_t n, cudaStream_t stream);
cudaError_t LaunchSquaredNorm(const float* x, int64_t n, double* result, cudaStream_t stream);
cudaError_t LaunchMaxAbs(const float* x, int64_t n, float* result, cudaStream_t stream);
cudaError_t LaunchSgd(const SgdHyperparams& hp, bool first_step, float* p, const float* g,
                      float* buf, int64_t n, cudaStream_t stream);
cudaError_t LaunchAdam(const AdamScalars& s, float* p, const float* g, float* m, float* v,
                       float* v_max, int64_t n, cudaStream_t stream);

}  // namespace flatshard::kernels::cuda::internal

#endif  // FLATSHARD_KERNELS_CUDA_LAUNCH_H_
