// ShardBuffer: bytes of one memory tier (host heap, pinned host or GPU device memory)
// owned together with the function that frees them. Move-only. Made by ShardCompute
// (server/shard_compute.h), which knows the tier; the buffer itself only frees.
// Not synchronized: its owner (a Group) serializes access.
//
//   absl::StatusOr<ShardBuffer> params = compute.AllocateShard(bytes, "group 'mlp' parameters");
//   float* p = params->floats();
#ifndef FLATSHARD_SERVER_SHARD_BUFFER_H_
#define FLATSHARD_SERVER_SHARD_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/types/span.h"

namespace flatshard::server {

class ShardBuffer {
 public:
  using Free = void (*)(void*);

  ShardBuffer() = default;
  ShardBuffer(void* data, size_t size, Free free) : data_(data), size_(size), free_(free) {}
  ShardBuffer(ShardBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        free_(std::exchange(other.free_, nullptr)) {}
  ShardBuffer& operator=(ShardBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      free_ = std::exchange(other.free_, nullptr);
    }
    return *this;
  }
  ~ShardBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t size() const { return size_; }
  float* floats() const { return static_cast<float*>(data_); }
  int64_t numel() const { return static_cast<int64_t>(size_ / sizeof(float)); }
  // Only for host-addressable tiers (host, pinned, and staging of every tier).
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

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_SHARD_BUFFER_H_
