#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "kernels/cuda/device.h"

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

// Runs in a fresh process (the death test re-executes this binary), where no device
// has a context yet. Exits 0 when every check holds, else with the number of the first
// that failed.
[[noreturn]] void CheckContextsInAFreshProcess(int devices) {
  if (HasPrimaryContext(0)) std::exit(1);  // asking creates nothing
  // A thread that never chose a device reports 0; working on the last device there must
  // not create device 0's context when the previous device is restored.
  std::thread([devices] {
    ScopedDevice on_device(devices - 1);
    if (cudaFree(nullptr) != cudaSuccess) std::exit(2);  // creates that device's context
  }).join();
  if (!HasPrimaryContext(devices - 1)) std::exit(3);
  if (devices > 1 && HasPrimaryContext(0)) std::exit(4);
  // A device whose context exists is restored.
  std::thread([devices] {
    if (cudaSetDevice(devices - 1) != cudaSuccess) std::exit(5);
    { ScopedDevice on_device(0); }
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != devices - 1) std::exit(6);
  }).join();
  std::exit(0);
}

TEST(CudaDeviceTest, ScopedDeviceRestoresOnlyDevicesInUse) {
  absl::StatusOr<int> count = DeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  if (*count == 0) GTEST_SKIP() << "no CUDA device (or no driver) on this machine";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(CheckContextsInAFreshProcess(*count), ::testing::ExitedWithCode(0), "")
      << "exit code: the check in CheckContextsInAFreshProcess that failed";
}

}  // namespace
}  // namespace flatshard::kernels::cuda
