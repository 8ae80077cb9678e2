// OwnedBuffer: bytes owned together with the function that frees them (free,
// cudaFreeHost, cudaFree, ...), or a piece of a larger block that several buffers share,
// which the last of them frees (server/host_slab.h). Move-only; frees (or lets go of its
// block) on destruction. Whoever allocates knows the kind of memory; the buffer itself
// only frees it. Not synchronized.
//
//   OwnedBuffer buffer(std::malloc(bytes), bytes, &std::free);
//   float* values = buffer.floats();
#ifndef FLATSHARD_CORE_OWNED_BUFFER_H_
#define FLATSHARD_CORE_OWNED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/types/span.h"

namespace flatshard {

class OwnedBuffer {
 public:
  using Free = void (*)(void*);

  OwnedBuffer() = default;
  // Takes ownership of `data` (`size` bytes), released with `free` (null: not freed).
  OwnedBuffer(void* data, size_t size, Free free) : data_(data), size_(size), free_(free) {}
  // `size` bytes at `data` inside a block that `block` keeps alive (and frees once no
  // buffer holds it any more).
  OwnedBuffer(void* data, size_t size, std::shared_ptr<const void> block)
      : data_(data), size_(size), block_(std::move(block)) {}
  OwnedBuffer(OwnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        free_(std::exchange(other.free_, nullptr)),
        block_(std::move(other.block_)) {}
  OwnedBuffer& operator=(OwnedBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      free_ = std::exchange(other.free_, nullptr);
      block_ = std::move(other.block_);
    }
    return *this;
  }
  ~OwnedBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t size() const { return size_; }
  float* floats() const { return static_cast<float*>(data_); }
  int64_t numel() const { return static_cast<int64_t>(size_ / sizeof(float)); }
  // Only for host-addressable memory.
  absl::Span<std::byte> bytes() const { return {static_cast<std::byte*>(data_), size_}; }

 private:
  void Reset() {
    if (data_ != nullptr && free_ != nullptr) free_(data_);
    data_ = nullptr;
    size_ = 0;
    free_ = nullptr;
    block_.reset();
  }

  void* data_ = nullptr;
  size_t size_ = 0;
  Free free_ = nullptr;
  std::shared_ptr<const void> block_;  // set for a piece of a shared block
};

}  // namespace flatshard

#endif  // FLATSHARD_CORE_OWNED_BUFFER_H_
