// How much more host memory the server may take before the kernel's OOM killer (or its
// cgroup's) would end it: MemAvailable from /proc/meminfo, lowered to the headroom under
// this process's cgroup memory limit where one is set (v2 memory.max, v1
// memory.limit_in_bytes). Host allocations of shards are
// checked against it, so that registering a model too large for the node is a
// RESOURCE_EXHAUSTED status instead of a server killed halfway through zeroing its
// shards (Linux overcommits: malloc succeeds, the first touch kills). An estimate at one
// moment: other processes allocate too. Thread-safe.
//
//   FLATSHARD_RETURN_IF_ERROR(CheckHostMemory(bytes, "group 'mlp' parameters", AvailableHostMemory()));
#ifndef FLATSHARD_SERVER_HOST_MEMORY_H_
#define FLATSHARD_SERVER_HOST_MEMORY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::server {

struct HostMemory {
  uint64_t available_bytes = 0;
  std::string limited_by;  // "MemAvailable", or the cgroup limit file that bounds it
};

// Reads /proc/meminfo and this process's cgroup memory limit and usage. Unavailable when
// /proc/meminfo cannot be read or parsed.
[[nodiscard]] absl::StatusOr<HostMemory> AvailableHostMemory();

// OK when `bytes` fit in `memory`, or when `memory` is unknown (not an error of the
// request); ResourceExhausted naming `what`, the bytes asked and the bytes available
// otherwise.
[[nodiscard]] absl::Status CheckHostMemory(uint64_t bytes, absl::string_view what,
                                           const absl::StatusOr<HostMemory>& memory);

// The parts of AvailableHostMemory, for tests.
// MemAvailable of /proc/meminfo's text, in bytes; InvalidArgument when absent.
[[nodiscard]] absl::StatusOr<uint64_t> ParseMemAvailable(absl::string_view meminfo);
// Where this process's cgroup and its ancestors keep their memory limits and usage, most
// specific first, from /proc/self/cgroup's text: "0::/x/y" (v2) ->
// /sys/fs/cgroup/x/y/memory.max and memory.current, then /sys/fs/cgroup/x/...;
// "4:memory:/x" (v1) -> /sys/fs/cgroup/memory/x/memory.limit_in_bytes and
// memory.usage_in_bytes; then the mount's root files (a container's own cgroup). The
// tightest headroom among the readable ones applies.
struct CgroupMemoryFiles {
  std::string limit;
  std::string usage;
};
std::vector<CgroupMemoryFiles> CgroupMemoryCandidates(absl::string_view proc_self_cgroup);
// limit minus usage (zero when over), from the two files' texts; nullopt when there is no
// limit ("max", or v1's near-2^63 "unlimited") or a text is not a number.
std::optional<uint64_t> CgroupHeadroom(absl::string_view limit, absl::string_view usage);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_HOST_MEMORY_H_
