#include "server/host_memory.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace flatshard::server {
namespace {

constexpr absl::string_view kCgroupRoot = "/sys/fs/cgroup";
// cgroup v1 reports "no limit" as the largest page-aligned value below 2^63.
constexpr uint64_t kNoLimitAbove = uint64_t{1} << 62;

// The text of a small file; /proc and /sys files report no size, so this reads to the end.
std::optional<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<uint64_t> ParseNumber(absl::string_view text) {
  uint64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value)) return std::nullopt;
  return value;
}

// "/a/b" -> "/a" -> "" (the root, whose files CgroupMemoryCandidates adds last).
std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

}  // namespace

absl::StatusOr<uint64_t> ParseMemAvailable(absl::string_view meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
    absl::string_view number = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&number, "kB")) break;
    if (std::optional<uint64_t> kib = ParseNumber(number)) return *kib * 1024;
    break;
  }
  return absl::InvalidArgumentError("no 'MemAvailable: N kB' line in /proc/meminfo");
}

std::vector<CgroupMemoryFiles> CgroupMemoryCandidates(absl::string_view proc_self_cgroup) {
  std::vector<CgroupMemoryFiles> candidates;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    const bool v2 = fields[0] == "0" && fields[1].empty();
    const std::vector<absl::string_view> controllers = absl::StrSplit(fields[1], ',');
    const bool v1 = std::find(controllers.begin(), controllers.end(), "memory") != controllers.end();
    // The cgroup and each of its ancestors: a limit on a parent (a systemd slice, say)
    // bounds this process as well.
    for (std::string path(absl::StripSuffix(fields[2], "/")); !path.empty(); path = Parent(path)) {
      if (v2) {
        candidates.push_back({absl::StrCat(kCgroupRoot, path, "/memory.max"),
                              absl::StrCat(kCgroupRoot, path, "/memory.current")});
      }
      if (v1) {
        candidates.push_back({absl::StrCat(kCgroupRoot, "/memory", path, "/memory.limit_in_bytes"),
                              absl::StrCat(kCgroupRoot, "/memory", path, "/memory.usage_in_bytes")});
      }
    }
  }
  candidates.push_back({absl::StrCat(kCgroupRoot, "/memory.max"),
                        absl::StrCat(kCgroupRoot, "/memory.current")});
  candidates.push_back({absl::StrCat(kCgroupRoot, "/memory/memory.limit_in_bytes"),
                        absl::StrCat(kCgroupRoot, "/memory/memory.usage_in_bytes")});
  return candidates;
}

std::optional<uint64_t> CgroupHeadroom(absl::string_view limit, absl::string_view usage) {
  const std::optional<uint64_t> max = ParseNumber(limit);
  const std::optional<uint64_t> current = ParseNumber(usage);
  if (!max.has_value() || !current.has_value() || *max >= kNoLimitAbove) return std::nullopt;
  return *max > *current ? *max - *current : 0;
}

absl::StatusOr<HostMemory> AvailableHostMemory() {
  const std::optional<std::string> meminfo = ReadSmallFile("/proc/meminfo");
  if (!meminfo.has_value()) return absl::UnavailableError("cannot read /proc/meminfo");
  absl::StatusOr<uint64_t> available = ParseMemAvailable(*meminfo);
  if (!available.ok()) return absl::UnavailableError(std::string(available.status().message()));
  HostMemory memory{*available, "MemAvailable"};
  const std::string cgroup = ReadSmallFile("/proc/self/cgroup").value_or("");
  for (const CgroupMemoryFiles& files : CgroupMemoryCandidates(cgroup)) {
    const std::optional<std::string> limit = ReadSmallFile(files.limit);
    const std::optional<std::string> usage = ReadSmallFile(files.usage);
    if (!limit.has_value() || !usage.has_value()) continue;
    const std::optional<uint64_t> headroom = CgroupHeadroom(*limit, *usage);
    if (headroom.has_value() && *headroom < memory.available_bytes) {
      memory = {*headroom, files.limit};
    }
  }
  return memory;
}

absl::Status CheckHostMemory(uint64_t bytes, absl::string_view what,
                             const absl::StatusOr<HostMemory>& memory) {
  if (!memory.ok() || bytes <= memory->available_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, ": ", bytes, " bytes of host memory asked, ", memory->available_bytes,
      " available (", memory->limited_by, ")"));
}

}  // namespace flatshard::server
