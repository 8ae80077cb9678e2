#include "kernels/cuda/device.h"

#include <gtest/gtest.h>

namespace flatshard::kernels::cuda {
namespace {

TEST(CudaDeviceTest, CountIsNonNegativeAndDevicesDescribeThemselves) {
  absl::StatusOr<int> count = DeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  ASSERT_GE(*count, 0);
  if (*count == 0) GTEST_SKIP() << "no CUDA device (or no driver) on this machine";
  for (int ordinal = 0; ordinal < *count; ++ordinal) {
    absl::StatusOr<std::string> description = DeviceDescription(ordinal);
    ASSERT_TRUE(description.ok()) << description.status();
    EXPECT_NE(description->find("sm_"), std::string::npos) << *description;
  }
  EXPECT_FALSE(DeviceDescription(*count).ok());
}

}  // namespace
}  // namespace flatshard::kernels::cuda
