// FLATSHARD_HOST_DEVICE marks a header-defined function that the CPU and CUDA kernels
// both call, so that each computes bit for bit the same thing: `__host__ __device__`
// under nvcc, nothing elsewhere. Such functions call only constexpr standard functions
// (nvcc builds with --expt-relaxed-constexpr) and the math functions CUDA also provides.
#ifndef FLATSHARD_CORE_HOST_DEVICE_H_
#define FLATSHARD_CORE_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define FLATSHARD_HOST_DEVICE __host__ __device__
#else
#define FLATSHARD_HOST_DEVICE
#endif

#endif  // FLATSHARD_CORE_HOST_DEVICE_H_
