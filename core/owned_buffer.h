// OwnedBuffer: bytes owned together with the function that frees them (free,
// cudaFreeHost, cudaFree, ...). Move-only; frees on destruction. Whoever allocates knows
// the kind of memory; the buffer itself only frees it. Not synchronized.
//
//   OwnedBuffer buffer(std::malloc(bytes), bytes, &std::free);
//   float* values = buffer.floats();
#ifndef FLATSHARD_CORE_OWNED_BUFFER_H_
#define FLATSHARD_CORE_OWNED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/types/span.h"

namespace flatshard {

class OwnedBuffer {
 public:
  using Free = void (*)(void*);

  OwnedBuffer() = default;
  // Takes ownership of `data` (`size` bytes), released with `free` (null: not freed).
  OwnedBuffer(void* data, size_t size, Free free) : data_(data), size_(size), free_(free) {}
  OwnedBuffer(OwnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        free_(std::exchange(other.free_, nullptr)) {}
  OwnedBuffer& operator=(OwnedBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      free_ = std::exchange(other.free_, nullptr);
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
  }

  void* data_ = nullptr;
  size_t size_ = 0;
  Free free_ = nullptr;
};

}  // namespace flatshard

#endif  // FLATSHARD_CORE_OWNED_BUFFER_H_
