#include "server/host_memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/group.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

constexpr absl::string_view kMeminfo =
    "MemTotal:       24682416 kB\n"
    "MemFree:        20000000 kB\n"
    "MemAvailable:   23139848 kB\n"
    "Buffers:          123456 kB\n";

TEST(HostMemoryTest, MemAvailableIsReadInBytes) {
  absl::StatusOr<uint64_t> available = ParseMemAvailable(kMeminfo);
  ASSERT_TRUE(available.ok()) << available.status();
  EXPECT_EQ(*available, uint64_t{23139848} * 1024);
  EXPECT_TRUE(absl::IsInvalidArgument(ParseMemAvailable("MemTotal: 1 kB\n").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseMemAvailable("MemAvailable: lots\n").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseMemAvailable("MemAvailable: 12 MB\n").status()));
}

TEST(HostMemoryTest, CgroupFilesComeFromV2AndV1EntriesAndTheirAncestorsThenTheMountRoot) {
  std::vector<CgroupMemoryFiles> v2 = CgroupMemoryCandidates("0::/system.slice/flatshard.service\n");
  ASSERT_EQ(v2.size(), 4u);
  EXPECT_EQ(v2[0].limit, "/sys/fs/cgroup/system.slice/flatshard.service/memory.max");
  EXPECT_EQ(v2[0].usage, "/sys/fs/cgroup/system.slice/flatshard.service/memory.current");
  EXPECT_EQ(v2[1].limit, "/sys/fs/cgroup/system.slice/memory.max");  // the slice's limit
  EXPECT_EQ(v2[2].limit, "/sys/fs/cgroup/memory.max");
  EXPECT_EQ(v2[3].limit, "/sys/fs/cgroup/memory/memory.limit_in_bytes");

  std::vector<CgroupMemoryFiles> v1 =
      CgroupMemoryCandidates("5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n");
  ASSERT_GE(v1.size(), 2u);
  EXPECT_EQ(v1[0].limit, "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes");
  EXPECT_EQ(v1[0].usage, "/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes");
  EXPECT_EQ(v1[1].limit, "/sys/fs/cgroup/memory/docker/memory.limit_in_bytes");
  EXPECT_EQ(v1[2].limit, "/sys/fs/cgroup/memory.max");  // "0::/" is the root

  EXPECT_EQ(CgroupMemoryCandidates("7:cpu,memory:/x\n")[0].limit,
            "/sys/fs/cgroup/memory/x/memory.limit_in_bytes");
  EXPECT_EQ(CgroupMemoryCandidates("").size(), 2u);  // no /proc/self/cgroup: the roots
  EXPECT_EQ(CgroupMemoryCandidates("0::relative\n").size(), 3u);  // malformed: no crash
}

TEST(HostMemoryTest, HeadroomIsLimitMinusUsageWhenThereIsALimit) {
  EXPECT_EQ(CgroupHeadroom("1000\n", "400\n"), std::optional<uint64_t>(600));
  EXPECT_EQ(CgroupHeadroom("1000", "1400"), std::optional<uint64_t>(0));
  EXPECT_EQ(CgroupHeadroom("max\n", "400\n"), std::nullopt);
  EXPECT_EQ(CgroupHeadroom("9223372036854771712\n", "3979386880\n"), std::nullopt);  // v1
  EXPECT_EQ(CgroupHeadroom("1000", ""), std::nullopt);
}

TEST(HostMemoryTest, CheckRefusesWhatDoesNotFitAndSaysWhy) {
  const HostMemory memory{1000, "MemAvailable"};
  EXPECT_TRUE(CheckHostMemory(1000, "x", memory).ok());
  const absl::Status status = CheckHostMemory(1001, "group 'g' gradient", memory);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_EQ(status.message(),
            "group 'g' gradient: 1001 bytes of host memory asked, 1000 available (MemAvailable)");
  // Unknown memory is not the request's fault.
  EXPECT_TRUE(CheckHostMemory(uint64_t{1} << 60, "x", absl::UnavailableError("no /proc")).ok());
}

TEST(HostMemoryTest, ThisMachineReportsSomethingPlausible) {
  absl::StatusOr<HostMemory> memory = AvailableHostMemory();
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_GT(memory->available_bytes, uint64_t{16} << 20);
  EXPECT_LT(memory->available_bytes, uint64_t{1} << 50);
  EXPECT_FALSE(memory->limited_by.empty());
}

// A host-tier group four times larger than the memory left is refused before anything is
// allocated; malloc alone would have succeeded (overcommit) up to RAM + swap, and zeroing
// the shard would have brought the OOM killer.
TEST(HostMemoryTest, RegisteringAGroupLargerThanTheNodeIsResourceExhausted) {
  absl::StatusOr<HostMemory> memory = AvailableHostMemory();
  ASSERT_TRUE(memory.ok()) << memory.status();
  const int64_t numel = static_cast<int64_t>(memory->available_bytes / sizeof(float)) * 4;
  auto layout = FlatLayout::Create({{"w", {numel}, DType::kFloat32}}, 0, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto group = Group::Create("job", "huge", *layout, Placement{}, JobSettings{.num_workers = 1},
                             kernels::AdamHyperparams{}, MemoryTier::kHost);
  EXPECT_TRUE(absl::IsResourceExhausted(group.status())) << group.status();
  EXPECT_THAT(std::string(group.status().message()), HasSubstr("group 'huge' parameters"));
  EXPECT_THAT(std::string(group.status().message()), HasSubstr("available"));
}

}  // namespace
}  // namespace flatshard::server
