// The host and pinned tiers (CPU kernels) and the tier factory.
#include "server/shard_compute.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "core/huge_pages.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"
#include "server/host_memory.h"
#if FLATSHARD_HAVE_CUDA
#include "server/cuda_shard_compute.h"
#endif

namespace flatshard::server {
namespace {

// Host allocations from this size on are checked against the memory left (host_memory.h).
constexpr size_t kCheckedHostBytes = size_t{16} << 20;

void FreeHost(void* data) { std::free(data); }

// Host memory, plain or pinned, and the CPU kernels, cut into chunks that run on the
// server's ComputePool. Everything completes in the call.
class CpuShardCompute final : public ShardCompute {
 public:
  // `allocate` returns memory not yet written (the tier's: heap or pinned).
  using Allocator = absl::StatusOr<ShardBuffer> (*)(size_t, absl::string_view);
  CpuShardCompute(MemoryTier tier, Allocator allocate, std::shared_ptr<const ComputePool> pool)
      : tier_(tier), allocate_(allocate), pool_(std::move(pool)) {}

  MemoryTier tier() const override { return tier_; }
  absl::StatusOr<ShardBuffer> AllocateShard(size_t bytes, absl::string_view what) override {
    return AllocateZeroed(bytes, what);
  }
  absl::StatusOr<ShardBuffer> AllocateStaging(size_t bytes, absl::string_view what) override {
    return AllocateZeroed(bytes, what);
  }

  absl::Status Cast(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                    int64_t numel) override {
    // Refuses a bad pair or count before anything is written.
    FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Cast(src_dtype, src, dst_dtype, dst, 0));
    if (numel < 0) return kernels::cpu::Cast(src_dtype, src, dst_dtype, dst, numel);
    const size_t src_size = DTypeSize(src_dtype), dst_size = DTypeSize(dst_dtype);
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      (void)kernels::cpu::Cast(src_dtype, static_cast<const char*>(src) + begin * src_size,
                               dst_dtype, static_cast<char*>(dst) + begin * dst_size, end - begin);
    });
    return absl::OkStatus();
  }
  absl::Status Reduce(absl::Span<const kernels::Contribution> contributions, float* dst,
                      int64_t numel, float alpha) override {
    FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Reduce(contributions, {}, alpha));  // validates
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      absl::InlinedVector<kernels::Contribution, 8> chunk;
      for (const kernels::Contribution& c : contributions) chunk.push_back({c.dtype, c.At(begin)});
      (void)kernels::cpu::Reduce(chunk, absl::MakeSpan(dst + begin, end - begin), alpha);
    });
    return absl::OkStatus();
  }
  absl::Status Scale(float* x, int64_t numel, float alpha) override {
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      kernels::cpu::Scale(absl::MakeSpan(x + begin, end - begin), alpha);
    });
    return absl::OkStatus();
  }
  absl::Status SgdStep(const kernels::SgdHyperparams& hp, bool first_step, float* param,
                       const float* grad, float* momentum_buffer, int64_t numel) override {
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      const size_t n = static_cast<size_t>(end - begin);
      kernels::cpu::SgdStep(hp, first_step, absl::MakeSpan(param + begin, n),
                            absl::MakeConstSpan(grad + begin, n), Optional(momentum_buffer, begin, n));
    });
    return absl::OkStatus();
  }
  absl::Status AdamStep(const kernels::AdamHyperparams& hp, int64_t step, float* param,
                        const float* grad, float* exp_avg, float* exp_avg_sq,
                        float* max_exp_avg_sq, int64_t numel) override {
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      const size_t n = static_cast<size_t>(end - begin);
      kernels::cpu::AdamStep(hp, step, absl::MakeSpan(param + begin, n),
                             absl::MakeConstSpan(grad + begin, n), absl::MakeSpan(exp_avg + begin, n),
                             absl::MakeSpan(exp_avg_sq + begin, n), Optional(max_exp_avg_sq, begin, n));
    });
    return absl::OkStatus();
  }
  // One thread: the sum's order (and so its bits) must not depend on the chunking.
  absl::StatusOr<double> NormPartial(const float* x, int64_t numel, double norm_type) override {
    const absl::Span<const float> values(x, numel);
    if (std::isinf(norm_type)) return static_cast<double>(kernels::cpu::MaxAbs(values));
    return kernels::cpu::SquaredNorm(values);
  }
  absl::Status CopyToHost(const float* shard, float* host, int64_t numel) override {
    CopyFloats(host, shard, numel);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(const float* host, float* shard, int64_t numel) override {
    CopyFloats(shard, host, numel);
    return absl::OkStatus();
  }
  absl::Status Zero(float* shard, int64_t numel) override {
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      std::memset(shard + begin, 0, (end - begin) * sizeof(float));
    });
    return absl::OkStatus();
  }
  absl::Status CopyBytes(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  // Zeroed on the pool: the first touch of fresh memory is what takes the time (the
  // kernel maps and clears every page), and the pool's threads take it in parallel.
  absl::StatusOr<ShardBuffer> AllocateZeroed(size_t bytes, absl::string_view what) {
    FLATSHARD_ASSIGN_OR_RETURN(ShardBuffer buffer, allocate_(bytes, what));
    if (bytes == 0) return buffer;  // no memory: nothing to touch (and no pointer to offset)
    auto* floats = static_cast<float*>(buffer.data());
    const int64_t numel = static_cast<int64_t>(bytes / sizeof(float));
    FLATSHARD_RETURN_IF_ERROR(Zero(floats, numel));
    std::memset(floats + numel, 0, bytes % sizeof(float));  // the tail of a 16-bit buffer
    return buffer;
  }

  void ForChunks(int64_t numel, absl::FunctionRef<void(int64_t, int64_t)> body) const {
    if (pool_ == nullptr) {
      if (numel > 0) body(0, numel);
    } else {
      pool_->ParallelFor(numel, body);
    }
  }
  void CopyFloats(float* dst, const float* src, int64_t numel) const {
    ForChunks(numel, [&](int64_t begin, int64_t end) {
      std::memcpy(dst + begin, src + begin, (end - begin) * sizeof(float));
    });
  }
  // Elements [begin, begin + n) of an optional buffer (null: not used, empty span).
  static absl::Span<float> Optional(float* buffer, int64_t begin, size_t n) {
    return buffer == nullptr ? absl::Span<float>() : absl::MakeSpan(buffer + begin, n);
  }

  const MemoryTier tier_;
  const Allocator allocate_;
  const std::shared_ptr<const ComputePool> pool_;  // null: the caller's thread only
};

#if !FLATSHARD_HAVE_CUDA
absl::Status NoCudaInThisBuild(absl::string_view name) {
  return absl::FailedPreconditionError(absl::StrCat(
      "--memory=", name, " needs CUDA, and this build has none (configure with FLATSHARD_CUDA=ON); use --memory=host"));
}
#endif

}  // namespace

// Large buffers are 2 MiB-aligned and advised for huge pages (core/huge_pages.h): shards
// are first written all at once. Small ones stay on plain pages, so that many small
// groups do not take 2 MiB each.
absl::StatusOr<ShardBuffer> AllocateHostUnwritten(size_t bytes, absl::string_view what) {
  if (bytes == 0) return ShardBuffer();
  // Linux overcommits: beyond what the node (or cgroup) has, malloc would succeed and the
  // first touch bring the OOM killer. Small buffers are not worth reading /proc for.
  if (bytes >= kCheckedHostBytes) {
    FLATSHARD_RETURN_IF_ERROR(CheckHostMemory(bytes, what, AvailableHostMemory()));
  }
  constexpr size_t kAlign = size_t{2} << 20;
  const bool huge = bytes >= 4 * kAlign;
  const size_t rounded = huge ? (bytes + kAlign - 1) / kAlign * kAlign : bytes;
  void* data = huge ? std::aligned_alloc(kAlign, rounded) : std::malloc(bytes);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes of host memory for ", what, " failed"));
  }
  if (huge) AdviseHugePages(data, rounded);
  return ShardBuffer(data, bytes, &FreeHost);
}

absl::string_view MemoryTierName(MemoryTier tier) {
  switch (tier) {
    case MemoryTier::kHost:
      return "host";
    case MemoryTier::kPinned:
      return "pinned";
    case MemoryTier::kDevice:
      return "device";
  }
  return "unknown";
}

absl::StatusOr<MemoryTier> ParseMemoryTier(absl::string_view name) {
  if (name == "host") return MemoryTier::kHost;
  if (name != "pinned" && name != "device") {
    return absl::InvalidArgumentError(
        absl::StrCat("--memory=", name, ": expected host, pinned or device"));
  }
#if FLATSHARD_HAVE_CUDA
  absl::Status device = internal::CheckCudaDevice();
  if (!device.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("--memory=", name, ": ", device.message()));
  }
  return name == "pinned" ? MemoryTier::kPinned : MemoryTier::kDevice;
#else
  return NoCudaInThisBuild(name);
#endif
}

absl::StatusOr<std::unique_ptr<ShardCompute>> MakeShardCompute(
    MemoryTier tier, std::shared_ptr<const ComputePool> pool) {
  switch (tier) {
    case MemoryTier::kHost:
      return std::make_unique<CpuShardCompute>(tier, &AllocateHostUnwritten, std::move(pool));
#if FLATSHARD_HAVE_CUDA
    case MemoryTier::kPinned:
      return std::make_unique<CpuShardCompute>(tier, &internal::AllocatePinnedUnwritten, std::move(pool));
    case MemoryTier::kDevice:
      return internal::MakeCudaShardCompute();
#else
    case MemoryTier::kPinned:
    case MemoryTier::kDevice:
      return NoCudaInThisBuild(MemoryTierName(tier));
#endif
  }
  return absl::InvalidArgumentError("unknown memory tier");
}

}  // namespace flatshard::server
