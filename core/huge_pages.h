// Large host buffers backed by transparent huge pages where the kernel allows it
// (/sys/kernel/mm/transparent_hugepage/enabled = always or madvise): a 256 MiB buffer
// then takes 128 page faults on first touch instead of 65536, which is most of the cost
// of filling a fresh buffer (checkpoint loads, snapshots). Harmless where THP is off.
// Pure functions; thread-safe.
//
//   std::vector<float> staging;
//   ResizeWithHugePages(staging, shard_numel);   // zero-filled, like resize()
#ifndef FLATSHARD_CORE_HUGE_PAGES_H_
#define FLATSHARD_CORE_HUGE_PAGES_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace flatshard {

// Asks for huge pages over the 2 MiB-aligned part of [data, data + bytes). Only useful
// before the memory is first touched.
inline void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

// `values` resized to `n` value-initialized elements, its new storage advised for huge
// pages before the elements are written. Precondition: `values` is empty.
template <typename T>
void ResizeWithHugePages(std::vector<T>& values, size_t n) {
  values.reserve(n);
  AdviseHugePages(values.data(), n * sizeof(T));
  values.resize(n);
}

}  // namespace flatshard

#endif  // FLATSHARD_CORE_HUGE_PAGES_H_
