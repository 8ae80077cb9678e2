// Byte buffers for transport tests: random bytes from a seed, and vectors of them seen as
// the spans transport::Connection sends and receives.
#ifndef FLATSHARD_TESTS_TRANSPORT_RANDOM_BYTES_H_
#define FLATSHARD_TESTS_TRANSPORT_RANDOM_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/types/span.h"

namespace flatshard::testing {

inline absl::Span<const std::byte> Bytes(const std::vector<uint8_t>& data) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()), data.size());
}
inline absl::Span<std::byte> Bytes(std::vector<uint8_t>& data) {
  return absl::MakeSpan(reinterpret_cast<std::byte*>(data.data()), data.size());
}

inline std::vector<uint8_t> RandomBytes(size_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> data(size);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  return data;
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_TRANSPORT_RANDOM_BYTES_H_
