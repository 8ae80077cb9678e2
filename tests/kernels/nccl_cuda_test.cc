// NCCL communicator set-up, transfers and teardown, with NCCL loaded at run time. One GPU
// allows only a single-rank communicator (NCCL refuses two ranks on one device): it
// sends a buffer to itself and receives it back. A two-rank communicator whose peer
// never comes is aborted at its deadline with DeadlineExceeded, or at a stop with
// Cancelled, instead of hanging; so is a wait whose other side gave the transfer up.
// Skips, with the reason, without a CUDA device or without libnccl.
#include "kernels/cuda/nccl.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <stop_token>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"

namespace flatshard::kernels::cuda {
namespace {

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<int> count = DeviceCount();
    ASSERT_TRUE(count.ok()) << count.status();
    if (*count == 0) GTEST_SKIP() << "no CUDA device (or no driver) on this machine";
    absl::StatusOr<std::string> version = NcclVersion();
    if (!version.ok()) GTEST_SKIP() << version.status().message();
    std::printf("NCCL %s\n", version->c_str());
  }
};

TEST_F(NcclTest, SingleRankCommunicatorSendsToItselfAndTearsDown) {
  absl::StatusOr<std::string> id = NcclCommunicator::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      NcclCommunicator::Create(*id, 1, 0, absl::Seconds(30));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const size_t bytes = (4 << 20) + 12;
  std::vector<unsigned char> host(bytes);
  std::mt19937 rng(std::random_device{}());
  for (auto& b : host) b = static_cast<unsigned char>(rng());
  absl::StatusOr<DeviceMemory> src = DeviceMemory::Allocate(bytes, "src");
  absl::StatusOr<DeviceMemory> dst = DeviceMemory::Allocate(bytes, "dst");
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_EQ(cudaMemcpy(src->data(), host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst->data(), 0xA5, bytes), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_TRUE((*comm)->GroupStart().ok());
  ASSERT_TRUE((*comm)->Send(src->data(), bytes, 0, stream).ok());
  ASSERT_TRUE((*comm)->Recv(dst->data(), bytes, 0, stream).ok());
  ASSERT_TRUE((*comm)->GroupEnd().ok());
  absl::Status waited = (*comm)->Wait(stream, absl::Seconds(30));
  ASSERT_TRUE(waited.ok()) << waited;
  std::vector<unsigned char> back(bytes);
  ASSERT_EQ(cudaMemcpy(back.data(), dst->data(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  comm->reset();  // finalize + destroy
  cudaStreamDestroy(stream);
}

TEST_F(NcclTest, AMissingPeerIsADeadlineNotAHang) {
  absl::StatusOr<std::string> id = NcclCommunicator::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      NcclCommunicator::Create(*id, 2, 0, absl::Seconds(2));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

// A stop asked from another thread (a worker's Ctrl-C, its client going away) ends the
// join at once, the communicator aborted, instead of at its 60 s deadline.
TEST_F(NcclTest, AStopEndsAJoinWhosePeerNeverComes) {
  absl::StatusOr<std::string> id = NcclCommunicator::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::stop_source stop;
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(300));
    stop.request_stop();
  });
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      NcclCommunicator::Create(*id, 2, 0, absl::Seconds(60), stop.get_token());
  const absl::Duration took = absl::Now() - start;
  stopper.join();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kCancelled) << comm.status();
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(20));
}

// A wait whose other side gave the transfer up (PeerGone: its request's connection
// closed) ends Cancelled at the next check instead of at its deadline, asking at most
// every kPeerCheck; work found finished is OK however gone the peer is. The unfinished
// work is a host function that blocks the stream (one GPU has no peer) until the check
// says the peer went: the abort that follows frees device memory, which waits for every
// stream of the device, as a real transfer's kernels end once NCCL aborts them. (Seen on
// an H100: released only after the wait, the abort waited for it, and the test hung.)
TEST_F(NcclTest, AWaitEndsOnceThePeerIsGoneAndAsksAtMostEveryPeerCheck) {
  absl::StatusOr<std::string> id = NcclCommunicator::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm = NcclCommunicator::Create(*id, 1, 0, absl::Seconds(30));
  ASSERT_TRUE(comm.ok()) << comm.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const PeerGone always_gone = [] { return true; };
  EXPECT_TRUE((*comm)->Wait(stream, absl::Seconds(30), {}, always_gone).ok()) << "an idle stream is finished work";

  absl::Notification release;
  ASSERT_EQ(cudaLaunchHostFunc(
                stream,
                [](void* released) {  // bounded: a wait that never ends fails the test, not hangs it
                  static_cast<absl::Notification*>(released)->WaitForNotificationWithTimeout(absl::Seconds(30));
                },
                &release),
            cudaSuccess);
  std::atomic<int> asked = 0;
  const absl::Time start = absl::Now();
  const PeerGone gone_after_300ms = [&] {
    ++asked;
    const bool gone = absl::Now() - start > absl::Milliseconds(300);
    if (gone && !release.HasBeenNotified()) release.Notify();
    return gone;
  };
  const absl::Status waited = (*comm)->Wait(stream, absl::Seconds(60), {}, gone_after_300ms);
  const absl::Duration took = absl::Now() - start;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled) << waited;
  EXPECT_NE(waited.message().find("the other side gave the transfer up"), std::string::npos) << waited;
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(20));
  EXPECT_LE(asked.load(), took / kPeerCheck + 1) << "asked more often than every kPeerCheck";
  EXPECT_FALSE((*comm)->Wait(stream, absl::Seconds(1)).ok()) << "the wait aborted the communicator";
  comm->reset();
  cudaStreamDestroy(stream);
}

TEST_F(NcclTest, MalformedArgumentsAreRefused) {
  EXPECT_EQ(NcclCommunicator::Create("short", 1, 0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> id = NcclCommunicator::NewUniqueId();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(NcclCommunicator::Create(*id, 2, 2, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flatshard::kernels::cuda
