// Norm reductions on the GPU in two deterministic passes: each block of the first pass
// reduces a fixed grid-stride share of the input into one partial, and one block of the
// second pass combines the partials in a fixed order. The same device and size give the
// same bits on every run. The partials live in stream-ordered scratch memory
// (cudaMallocAsync), so nothing waits for the host.
#include <cmath>

#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/launch.h"

namespace flatshard::kernels::cuda::internal {
namespace {

struct SumSquares {
  using Value = double;
  static __device__ Value Identity() { return 0.0; }
  static __device__ Value Of(float x) {
    const double d = x;
    return d * d;
  }
  static __device__ Value Combine(Value a, Value b) { return a + b; }
};

struct MaxMagnitude {
  using Value = float;
  static __device__ Value Identity() { return 0.0f; }
  static __device__ Value Of(float x) { return fabsf(x); }
  // NaN wins, as torch.linalg.vector_norm(ord=inf) propagates it.
  static __device__ Value Combine(Value a, Value b) {
    if (isnan(a) || isnan(b)) return NAN;
    return a > b ? a : b;
  }
};

template <typename Op>
__device__ typename Op::Value BlockReduce(typename Op::Value value) {
  __shared__ typename Op::Value warp_values[kThreadsPerBlock / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    value = Op::Combine(value, __shfl_down_sync(0xFFFFFFFFu, value, offset));
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_values[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreadsPerBlock / 32 ? warp_values[lane] : Op::Identity();
    for (int offset = 16; offset > 0; offset /= 2) {
      value = Op::Combine(value, __shfl_down_sync(0xFFFFFFFFu, value, offset));
    }
  }
  return value;  // meaningful in thread 0
}

template <typename Op>
__global__ void __launch_bounds__(kThreadsPerBlock)
    PartialKernel(const float* x, int64_t n, bool vectorized, typename Op::Value* partials) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  typename Op::Value acc = Op::Identity();
  int64_t scalar_begin = 0;
  if (vectorized) {
    const int64_t groups = n / kVector;
    for (int64_t g = tid; g < groups; g += stride) {
      const float4 v = reinterpret_cast<const float4*>(x)[g];
      acc = Op::Combine(acc, Op::Combine(Op::Combine(Op::Of(v.x), Op::Of(v.y)),
                                         Op::Combine(Op::Of(v.z), Op::Of(v.w))));
    }
    scalar_begin = groups * kVector;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) acc = Op::Combine(acc, Op::Of(x[i]));
  acc = BlockReduce<Op>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <typename Op>
__global__ void __launch_bounds__(kThreadsPerBlock)
    FinalKernel(const typename Op::Value* partials, int count, typename Op::Value* result) {
  typename Op::Value acc = Op::Identity();
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc = Op::Combine(acc, partials[i]);
  acc = BlockReduce<Op>(acc);
  if (threadIdx.x == 0) *result = acc;
}

template <typename Op>
cudaError_t LaunchReduce(const float* x, int64_t n, typename Op::Value* result,
                         cudaStream_t stream) {
  const bool vectorized = Aligned(x, 16);
  const int blocks = GridSize(vectorized ? (n + kVector - 1) / kVector : n);
  typename Op::Value* partials = nullptr;
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&partials),
                                    sizeof(typename Op::Value) * blocks, stream);
  if (err != cudaSuccess) return err;
  PartialKernel<Op><<<blocks, kThreadsPerBlock, 0, stream>>>(x, n, vectorized, partials);
  FinalKernel<Op><<<1, kThreadsPerBlock, 0, stream>>>(partials, blocks, result);
  err = cudaGetLastError();
  const cudaError_t free_err = cudaFreeAsync(partials, stream);
  return err != cudaSuccess ? err : free_err;
}

}  // namespace

cudaError_t LaunchSquaredNorm(const float* x, int64_t n, double* result, cudaStream_t stream) {
  return LaunchReduce<SumSquares>(x, n, result, stream);
}

cudaError_t LaunchMaxAbs(const float* x, int64_t n, float* result, cudaStream_t stream) {
  return LaunchReduce<MaxMagnitude>(x, n, result, stream);
}

}  // namespace flatshard::kernels::cuda::internal
