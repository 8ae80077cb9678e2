// Internal to kernels/cuda: the grid-stride element-wise kernel the .cu files build on.
//
// A Body has Vector(g), which handles elements [4g, 4g + 4) with wide loads and stores,
// and Scalar(i) for one element. Launch(body, n, vectorized) runs Vector over every whole
// group of four when `vectorized` (the caller checked the pointers' alignment), then
// Scalar over the rest; one wave of blocks strides over the whole range.
#ifndef FLATSHARD_KERNELS_CUDA_ELEMENTWISE_CUH_
#define FLATSHARD_KERNELS_CUDA_ELEMENTWISE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace flatshard::kernels::cuda::internal {

constexpr int kThreadsPerBlock = 256;
constexpr int kVector = 4;  // elements per Vector() call

// Blocks for `work_items` threads' worth of work, capped at one full wave of the
// current device (grid-stride loops cover the rest).
inline int GridSize(int64_t work_items) {
  int device = 0, sms = 132, blocks_per_sm = 2048 / kThreadsPerBlock;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t wanted = (work_items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int64_t cap = static_cast<int64_t>(sms) * blocks_per_sm;
  return static_cast<int>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

inline bool Aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

template <typename Body>
__global__ void __launch_bounds__(kThreadsPerBlock) ElementwiseKernel(Body body, int64_t n,
                                                                      bool vectorized) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vectorized) {
    const int64_t groups = n / kVector;
    for (int64_t g = tid; g < groups; g += stride) body.Vector(g);
    scalar_begin = groups * kVector;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) body.Scalar(i);
}

template <typename Body>
cudaError_t Launch(const Body& body, int64_t n, bool vectorized, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t work = vectorized ? (n + kVector - 1) / kVector : n;
  ElementwiseKernel<<<GridSize(work), kThreadsPerBlock, 0, stream>>>(body, n, vectorized);
  return cudaGetLastError();
}

// Four 16-bit values (8 bytes) as one load/store.
struct alignas(8) Half4 {
  uint16_t x, y, z, w;
};

}  // namespace flatshard::kernels::cuda::internal

#endif  // FLATSHARD_KERNELS_CUDA_ELEMENTWISE_CUH_
