// Casts, accumulation, reduction and scaling on the GPU, using the CPU kernels' element
// code (fp32 -> fp16 narrowing uses the hardware conversion, which rounds identically).
#include <cuda_fp16.h>

#include "core/float_bits.h"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/launch.h"

namespace flatshard::kernels::cuda::internal {
namespace {

template <HalfKind kKind>
__device__ inline uint16_t ToHalf(float x) {
  if constexpr (kKind == HalfKind::kBFloat16) {
    return FloatToBFloat16Bits(x);
  } else {
    // The hardware conversion rounds to nearest even exactly as FloatToHalfBits does,
    // subnormals and overflow included, in one instruction; only NaN differs (it gives
    // one canonical NaN where flatshard keeps the sign), so NaN takes the shared code.
    const uint16_t converted = __half_as_ushort(__float2half_rn(x));
    return x != x ? FloatToHalfBits(x) : converted;
  }
}

template <HalfKind kKind>
__device__ inline float FromHalf(uint16_t x) {
  if constexpr (kKind == HalfKind::kBFloat16) {
    return BFloat16BitsToFloat(x);
  } else {
    return HalfBitsToFloat(x);
  }
}

template <HalfKind kKind>
struct CastToHalf {
  const float* src;
  uint16_t* dst;
  __device__ void Vector(int64_t g) const {
    const float4 in = reinterpret_cast<const float4*>(src)[g];
    reinterpret_cast<Half4*>(dst)[g] =
        Half4{ToHalf<kKind>(in.x), ToHalf<kKind>(in.y), ToHalf<kKind>(in.z), ToHalf<kKind>(in.w)};
  }
  __device__ void Scalar(int64_t i) const { dst[i] = ToHalf<kKind>(src[i]); }
};

template <HalfKind kKind>
struct CastFromHalf {
  const uint16_t* src;
  float* dst;
  __device__ void Vector(int64_t g) const {
    const Half4 in = reinterpret_cast<const Half4*>(src)[g];
    reinterpret_cast<float4*>(dst)[g] = make_float4(FromHalf<kKind>(in.x), FromHalf<kKind>(in.y),
                                                    FromHalf<kKind>(in.z), FromHalf<kKind>(in.w));
  }
  __device__ void Scalar(int64_t i) const { dst[i] = FromHalf<kKind>(src[i]); }
};

struct AccumulateF32 {
  const float* src;
  float* dst;
  __device__ void Vector(int64_t g) const {
    const float4 in = reinterpret_cast<const float4*>(src)[g];
    float4 acc = reinterpret_cast<float4*>(dst)[g];
    acc.x += in.x;
    acc.y += in.y;
    acc.z += in.z;
    acc.w += in.w;
    reinterpret_cast<float4*>(dst)[g] = acc;
  }
  __device__ void Scalar(int64_t i) const { dst[i] += src[i]; }
};

template <HalfKind kKind>
struct AccumulateHalf {
  const uint16_t* src;
  float* dst;
  __device__ void Vector(int64_t g) const {
    const Half4 in = reinterpret_cast<const Half4*>(src)[g];
    float4 acc = reinterpret_cast<float4*>(dst)[g];
    acc.x += FromHalf<kKind>(in.x);
    acc.y += FromHalf<kKind>(in.y);
    acc.z += FromHalf<kKind>(in.z);
    acc.w += FromHalf<kKind>(in.w);
    reinterpret_cast<float4*>(dst)[g] = acc;
  }
  __device__ void Scalar(int64_t i) const { dst[i] += FromHalf<kKind>(src[i]); }
};

struct ScaleBody {
  float* x;
  float alpha;
  __device__ void Vector(int64_t g) const {
    float4 v = reinterpret_cast<float4*>(x)[g];
    v.x *= alpha;
    v.y *= alpha;
    v.z *= alpha;
    v.w *= alpha;
    reinterpret_cast<float4*>(x)[g] = v;
  }
  __device__ void Scalar(int64_t i) const { x[i] *= alpha; }
};

// The workers' gradients summed in order into dst, each read once (one pass instead of a
// cast, an accumulate per further worker and a scale).
struct ReduceBody {
  ReduceSources sources;
  float* dst;
  bool accumulate;
  bool scale;
  float alpha;

  __device__ float Load(int j, int64_t i) const {
    switch (sources.kind[j]) {
      case SourceKind::kFloat32:
        return static_cast<const float*>(sources.data[j])[i];
      case SourceKind::kBFloat16:
        return FromHalf<HalfKind::kBFloat16>(static_cast<const uint16_t*>(sources.data[j])[i]);
      default:
        return FromHalf<HalfKind::kFloat16>(static_cast<const uint16_t*>(sources.data[j])[i]);
    }
  }
  __device__ float4 Load4(int j, int64_t g) const {
    if (sources.kind[j] == SourceKind::kFloat32) {
      return reinterpret_cast<const float4*>(sources.data[j])[g];
    }
    const Half4 in = reinterpret_cast<const Half4*>(sources.data[j])[g];
    if (sources.kind[j] == SourceKind::kBFloat16) {
      return make_float4(FromHalf<HalfKind::kBFloat16>(in.x), FromHalf<HalfKind::kBFloat16>(in.y),
                         FromHalf<HalfKind::kBFloat16>(in.z), FromHalf<HalfKind::kBFloat16>(in.w));
    }
    return make_float4(FromHalf<HalfKind::kFloat16>(in.x), FromHalf<HalfKind::kFloat16>(in.y),
                       FromHalf<HalfKind::kFloat16>(in.z), FromHalf<HalfKind::kFloat16>(in.w));
  }
  __device__ void Vector(int64_t g) const {
    float4 acc = accumulate ? reinterpret_cast<const float4*>(dst)[g] : Load4(0, g);
    for (int j = accumulate ? 0 : 1; j < sources.count; ++j) {
      const float4 in = Load4(j, g);
      acc.x += in.x;
      acc.y += in.y;
      acc.z += in.z;
      acc.w += in.w;
    }
    if (scale) {
      acc.x *= alpha;
      acc.y *= alpha;
      acc.z *= alpha;
      acc.w *= alpha;
    }
    reinterpret_cast<float4*>(dst)[g] = acc;
  }
  __device__ void Scalar(int64_t i) const {
    float acc = accumulate ? dst[i] : Load(0, i);
    for (int j = accumulate ? 0 : 1; j < sources.count; ++j) acc += Load(j, i);
    if (scale) acc *= alpha;
    dst[i] = acc;
  }
};

bool HalfPairAligned(const float* f, const uint16_t* h) { return Aligned(f, 16) && Aligned(h, 8); }

}  // namespace

cudaError_t LaunchCastToHalf(HalfKind kind, const float* src, uint16_t* dst, int64_t n,
                             cudaStream_t stream) {
  const bool vec = HalfPairAligned(src, dst);
  return kind == HalfKind::kBFloat16
             ? Launch(CastToHalf<HalfKind::kBFloat16>{src, dst}, n, vec, stream)
             : Launch(CastToHalf<HalfKind::kFloat16>{src, dst}, n, vec, stream);
}

cudaError_t LaunchCastFromHalf(HalfKind kind, const uint16_t* src, float* dst, int64_t n,
                               cudaStream_t stream) {
  const bool vec = HalfPairAligned(dst, src);
  return kind == HalfKind::kBFloat16
             ? Launch(CastFromHalf<HalfKind::kBFloat16>{src, dst}, n, vec, stream)
             : Launch(CastFromHalf<HalfKind::kFloat16>{src, dst}, n, vec, stream);
}

cudaError_t LaunchAccumulateFloat32(const float* src, float* dst, int64_t n, cudaStream_t stream) {
  return Launch(AccumulateF32{src, dst}, n, Aligned(src, 16) && Aligned(dst, 16), stream);
}

cudaError_t LaunchAccumulateHalf(HalfKind kind, const uint16_t* src, float* dst, int64_t n,
                                 cudaStream_t stream) {
  const bool vec = HalfPairAligned(dst, src);
  return kind == HalfKind::kBFloat16
             ? Launch(AccumulateHalf<HalfKind::kBFloat16>{src, dst}, n, vec, stream)
             : Launch(AccumulateHalf<HalfKind::kFloat16>{src, dst}, n, vec, stream);
}

cudaError_t LaunchScale(float* x, int64_t n, float alpha, cudaStream_t stream) {
  return Launch(ScaleBody{x, alpha}, n, Aligned(x, 16), stream);
}

cudaError_t LaunchReduce(const ReduceSources& sources, bool accumulate, bool scale, float alpha,
                         float* dst, int64_t n, cudaStream_t stream) {
  bool vec = Aligned(dst, 16);
  for (int j = 0; j < sources.count; ++j) {
    vec = vec && Aligned(sources.data[j], sources.kind[j] == SourceKind::kFloat32 ? 16 : 8);
  }
  return Launch(ReduceBody{sources, dst, accumulate, scale, alpha}, n, vec, stream);
}

}  // namespace flatshard::kernels::cuda::internal
