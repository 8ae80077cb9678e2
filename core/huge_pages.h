// Large host buffers backed by transparent huge pages where the kernel allows it
// (/sys/kernel/mm/transparent_hugepage/enabled = always or madvise): a 256 MiB buffer
// then takes 128 page faults on first touch instead of 65536, which is most of the cost
// of filling a fresh buffer (snapshots, checkpoint loads). Harmless where THP is off.
// HostFloats are such buffers left unwritten on resize, for whoever overwrites them
// whole (snapshots): a zero fill first is a pass over memory, and on
// fresh pages it takes the page faults in the thread that fills rather than the threads
// that write. Pure functions; thread-safe.
//
//   std::vector<float> zeroed;
//   ResizeWithHugePages(zeroed, shard_numel);      // zero-filled, like resize()
//   HostFloats staging;
//   ResizeWithHugePages(staging, shard_numel);     // unwritten: fill every element
#ifndef FLATSHARD_CORE_HUGE_PAGES_H_
#define FLATSHARD_CORE_HUGE_PAGES_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
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

// An allocator that default-initializes where std::allocator value-initializes: floats
// in a vector resized with it are left unwritten.
template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <typename U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using HostFloats = std::vector<float, UninitializedAllocator<float>>;

// `values` resized to `n` value-initialized (HostFloats: unwritten) elements, its new
// storage advised for huge pages before the elements are written. Precondition: `values`
// is empty.
template <typename T, typename Allocator>
void ResizeWithHugePages(std::vector<T, Allocator>& values, size_t n) {
  values.reserve(n);
  AdviseHugePages(values.data(), n * sizeof(T));
  values.resize(n);
}

}  // namespace flatshard

#endif  // FLATSHARD_CORE_HUGE_PAGES_H_
