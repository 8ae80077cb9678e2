// Transfers split over several connections. Gathers in ranges
// (ClientOptions::gather_split_bytes): bitwise the same as whole gathers in every dtype,
// counted once by the servers, and never a mix of two versions when the group steps
// during the gather. Scatters in parts (ClientOptions::scatter_split_bytes): training
// reaches the same bits as with whole scatters, each contribution counted once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "client/cluster_status.h"
#include "kernels/cpu/cast.h"
#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

using testing::TestCluster;

// Splits every gather of more than 4 KiB per server into up to 3 ranges.
ClientOptions Splitting(const std::string& job) {
  return {.job = job, .timeout = absl::Seconds(20), .max_in_flight = 3, .gather_split_bytes = 4096};
}

TEST(SplitGatherTest, RangesGatherTheSameBitsAsWholeGathersAndCountOnce) {
  TestCluster cluster(2, "split-token", ::testing::TempDir());
  auto split = cluster.Connect(Splitting("split"));
  ClientOptions whole_options = Splitting("split");
  whole_options.gather_split_bytes = 0;
  auto whole = cluster.Connect(whole_options);
  ASSERT_TRUE(split.ok() && whole.ok()) << split.status() << whole.status();
  ASSERT_TRUE((*split)->ConfigureJob({}).ok());
  // 10037 elements: 5019 per server, so the ranges are uneven.
  auto layout = (*split)->RegisterGroup("g", {{"w", {10037}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE((*whole)->RegisterGroup("g", {{"w", {10037}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5}).ok());
  ASSERT_TRUE((*split)->InitGroupFromSeed("g", 11).ok());
  const size_t numel = (*layout)->padded_numel();
  std::vector<float> grad(numel, 0.25f);
  ASSERT_TRUE((*split)->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());

  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    std::vector<std::byte> a(numel * DTypeSize(dtype), std::byte{0xAA}), b(a.size(), std::byte{0x55});
    auto va = (*split)->Gather("g", 1, dtype, absl::MakeSpan(a)).get();
    auto vb = (*whole)->Gather("g", 1, dtype, absl::MakeSpan(b)).get();
    ASSERT_TRUE(va.ok() && vb.ok()) << va.status() << vb.status();
    EXPECT_EQ(*va, 1);
    EXPECT_EQ(*vb, 1);
    EXPECT_EQ(a, b) << DTypeName(dtype);
  }
  // 3 dtypes x 2 clients, each counted once per server however many ranges it took.
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->gathers(), 6);
  }
}

// An async job steps on every contribution while another client gathers in ranges: each
// server's part of a gather must hold one version throughout (params = version there).
// Servers step independently in async mode, so the parts may differ from each other;
// the gather returns the lowest.
TEST(SplitGatherTest, AGroupSteppingMeanwhileNeverYieldsAMixOfVersions) {
  TestCluster cluster(2, "split-token", ::testing::TempDir());
  auto writer = cluster.Connect(0, 1, "async");
  auto reader = cluster.Connect(Splitting("async"));
  ASSERT_TRUE(writer.ok() && reader.ok()) << writer.status() << reader.status();
  ASSERT_TRUE((*writer)->ConfigureJob({.async = true}).ok());
  auto layout = (*writer)->RegisterGroup("g", {{"w", {40000}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE((*reader)->RegisterGroup("g", {{"w", {40000}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0}).ok());
  ASSERT_EQ((*layout)->padded_numel(), 40000);
  ASSERT_TRUE((*writer)->InitGroup("g", std::vector<float>(40000, 0.0f)).ok());

  constexpr int kSteps = 150;
  std::atomic<bool> writing{true};
  std::thread steps([&] {
    const std::vector<float> minus_one(40000, -1.0f);  // SGD lr 1: every step adds 1
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_TRUE((*writer)->Scatter("g", step, DType::kFloat32, AsBytes(minus_one)).get().ok());
    }
    writing = false;
  });
  // Stops at the first failure; the writer is always joined.
  auto consistent_gather = [&]() -> bool {
    std::vector<float> params(40000);
    auto version = (*reader)->Gather("g", 0, DType::kFloat32, AsBytes(params)).get();
    EXPECT_TRUE(version.ok()) << version.status();
    if (!version.ok()) return false;
    float lowest = kSteps;
    for (size_t server = 0; server < 2; ++server) {
      const float* part = params.data() + server * 20000;
      for (size_t i = 0; i < 20000; ++i) {
        if (part[i] != part[0]) {
          ADD_FAILURE() << "element " << i << " of server " << server << "'s part is " << part[i]
                        << ", element 0 is " << part[0];
          return false;
        }
      }
      lowest = std::min(lowest, part[0]);
    }
    EXPECT_EQ(static_cast<float>(*version), lowest);
    return true;
  };
  int gathers = 0;
  while ((writing || gathers < 5) && consistent_gather()) ++gathers;
  steps.join();
  EXPECT_GE(gathers, 5);
}

// Futures outlive their Client: destroying it cancels the gathers in flight (here split
// ones, whose parts a thread of the client's combines) and returns once they have let go
// of their buffers, every future ready with Cancelled. The servers serve on.
TEST(SplitGatherTest, DestroyingTheClientCancelsItsGathersInFlight) {
  TestCluster cluster(2, "split-token", ::testing::TempDir());
  auto gatherer = cluster.Connect(Splitting("drop"));
  ClientOptions stepper_options = Splitting("drop");
  stepper_options.worker_rank = 0;
  auto stepper = cluster.Connect(stepper_options);
  ASSERT_TRUE(gatherer.ok() && stepper.ok()) << gatherer.status() << stepper.status();
  ASSERT_TRUE((*stepper)->ConfigureJob({}).ok());
  const std::vector<TensorSpec> tensors = {{"w", {10037}, DType::kFloat32}};
  auto layout = (*stepper)->RegisterGroup("g", tensors, 0, SgdOptions{.lr = 0.5});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE((*gatherer)->RegisterGroup("g", tensors, 0, SgdOptions{.lr = 0.5}).ok());
  ASSERT_TRUE((*stepper)->InitGroupFromSeed("g", 5).ok());
  const size_t numel = (*layout)->padded_numel();

  // Version 1 does not exist yet: the gathers wait on the servers.
  std::vector<std::vector<float>> outs(4, std::vector<float>(numel));
  std::vector<std::future<absl::StatusOr<int64_t>>> pending;
  for (auto& out : outs) pending.push_back((*gatherer)->Gather("g", 1, DType::kFloat32, AsBytes(out)));
  absl::SleepFor(absl::Milliseconds(200));  // the first ones wait on the servers, the rest queued
  gatherer->reset();
  for (size_t i = 0; i < pending.size(); ++i) {
    ASSERT_EQ(pending[i].wait_for(std::chrono::seconds(0)), std::future_status::ready) << i;
    const absl::StatusOr<int64_t> version = pending[i].get();
    EXPECT_TRUE(absl::IsCancelled(version.status())) << i << ": " << version.status();
  }
  std::vector<float> grad(numel, 1.0f);
  ASSERT_TRUE((*stepper)->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  std::vector<float> gathered(numel);
  EXPECT_EQ((*stepper)->Gather("g", 1, DType::kFloat32, AsBytes(gathered)).get().value_or(-1), 1);
}

// Two jobs of two workers train on the same gradients, one scattering in parts (3 per
// server), one whole, in float32 and bfloat16 steps; their parameters stay bitwise equal.
TEST(SplitScatterTest, PartsTrainToTheSameBitsAsWholeScattersAndCountOnce) {
  TestCluster cluster(2, "split-token", ::testing::TempDir());
  const std::vector<TensorSpec> tensors = {{"w", {10037}, DType::kFloat32}};
  std::unique_ptr<Client> workers[2][2];  // [split?][rank]
  size_t numel = 0;
  for (int split = 0; split < 2; ++split) {
    for (int rank = 0; rank < 2; ++rank) {
      auto client = cluster.Connect({.worker_rank = rank,
                                     .num_workers = 2,
                                     .job = split ? "split" : "whole",
                                     .timeout = absl::Seconds(20),
                                     .max_in_flight = 3,
                                     .scatter_split_bytes = split ? 4096 : 0});
      ASSERT_TRUE(client.ok()) << client.status();
      workers[split][rank] = *std::move(client);
      if (rank == 0) {
        ASSERT_TRUE(workers[split][0]->ConfigureJob({}).ok());
      }
      auto layout = workers[split][rank]->RegisterGroup("g", tensors, 0, SgdOptions{.lr = 0.1, .momentum = 0.9});
      ASSERT_TRUE(layout.ok()) << layout.status();
      numel = (*layout)->padded_numel();
    }
    ASSERT_TRUE(workers[split][0]->InitGroupFromSeed("g", 3).ok());
  }
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int kSteps = 4;
  for (int step = 0; step < kSteps; ++step) {
    const DType dtype = step % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
    std::vector<std::future<absl::Status>> scatters;
    std::vector<std::vector<std::byte>> grads(2);
    for (int rank = 0; rank < 2; ++rank) {
      std::vector<float> grad(numel);
      for (float& value : grad) value = normal(rng);
      grads[rank].resize(numel * DTypeSize(dtype));
      ASSERT_TRUE(kernels::cpu::Cast(DType::kFloat32, grad.data(), dtype, grads[rank].data(),
                                     static_cast<int64_t>(numel)).ok());
      for (int split = 0; split < 2; ++split) {
        scatters.push_back(workers[split][rank]->Scatter("g", step, dtype, absl::MakeSpan(grads[rank])));
      }
    }
    for (auto& scatter : scatters) ASSERT_TRUE(scatter.get().ok()) << "step " << step;
    std::vector<float> split_params(numel), whole_params(numel);
    ASSERT_EQ(workers[1][0]->Gather("g", step + 1, DType::kFloat32, AsBytes(split_params)).get().value_or(-1), step + 1);
    ASSERT_EQ(workers[0][0]->Gather("g", step + 1, DType::kFloat32, AsBytes(whole_params)).get().value_or(-1), step + 1);
    ASSERT_EQ(std::memcmp(split_params.data(), whole_params.data(), numel * sizeof(float)), 0) << "step " << step;
  }
  // 2 jobs x 2 workers x 4 steps, however many parts each came in.
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->scatters(), 2 * 2 * kSteps);
  }
}

}  // namespace
}  // namespace flatshard
