// Trainer: a training worker of job "test" for the checkpoint integration tests, with
// two groups that step in sync mode: "big" (two fp32 tensors, AdamW) and "tiny" (one
// element, SGD with momentum). Its gradients are a fixed function of the step and the
// worker's rank, so that runs can be repeated and compared bit for bit. Failures are
// gtest failures. Not thread-safe. Helpers beside it: Operator connects a client that
// sends no gradients; ListedVersions lists the checkpoints' versions; MustWaitFor checks
// that an operation waits (for a step another worker has yet to complete, say);
// AwaitNoCheckpointInProgress, that the servers have let go of a save that timed out.
#ifndef FLATSHARD_TESTS_INTEGRATION_TRAINER_H_
#define FLATSHARD_TESTS_INTEGRATION_TRAINER_H_

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/cluster_status.h"
#include "flatshard/client.h"
#include "tests/integration/test_cluster.h"

namespace flatshard::testing {

inline const std::vector<TensorSpec> kTensors = {{"fc.weight", {7, 5}, DType::kFloat32},
                                                 {"fc.bias", {7}, DType::kFloat32}};
inline const std::vector<TensorSpec> kTiny = {{"gain", {1}, DType::kFloat32}};
inline const AdamOptions kAdam{.lr = 0.01, .weight_decay = 0.05, .decoupled_weight_decay = true};

struct Trainer {
  std::unique_ptr<Client> client;
  const FlatLayout* big = nullptr;
  const FlatLayout* tiny = nullptr;

  int worker = 0;

  explicit Trainer(const TestCluster& cluster, int worker_rank = 0, int num_workers = 1, const JobOptions& job = {},
                   absl::Duration timeout = absl::Seconds(20), DevicePlane plane = DevicePlane::kAuto)
      : worker(worker_rank) {
    auto connected = cluster.Connect({.worker_rank = worker_rank,
                                      .num_workers = num_workers,
                                      .job = "test",
                                      .timeout = timeout,
                                      .device_plane = plane});
    EXPECT_TRUE(connected.ok()) << connected.status();
    client = std::move(*connected);
    EXPECT_TRUE(client->ConfigureJob(job).ok());
    big = *client->RegisterGroup("big", kTensors, 4, kAdam);
    tiny = *client->RegisterGroup("tiny", kTiny, 0, SgdOptions{.lr = 0.1, .momentum = 0.9});
  }

  void Step(int64_t step) {
    Send("big", step);
    Send("tiny", step);
  }

  // Sends this worker's gradient of group `name` ("big" or "tiny") for `step`.
  void Send(const std::string& name, int64_t step) {
    const std::vector<float> grad = Gradient(name, step);
    ASSERT_TRUE(client->Scatter(name, step, DType::kFloat32, AsBytes(grad)).get().ok());
  }

  // This worker's gradient of group `name` for `step` (padded_numel elements): a function
  // of the step and the worker only.
  std::vector<float> Gradient(const std::string& name, int64_t step) const {
    const FlatLayout* layout = name == "big" ? big : tiny;
    std::vector<float> grad(layout->padded_numel(), 0.0f);
    for (const TensorPiece& piece : layout->MapRange(0, layout->padded_numel())) {
      for (int64_t k = 0; k < piece.numel; ++k) {
        grad[piece.flat_offset + k] =
            std::cos(0.3f * static_cast<float>(piece.flat_offset + k) + static_cast<float>(step + 7 * worker));
      }
    }
    return grad;
  }

  std::vector<float> Params(const std::string& name, const FlatLayout* layout, int64_t version) {
    std::vector<float> values(layout->padded_numel());
    auto got = client->Gather(name, version, DType::kFloat32, AsBytes(values)).get();
    EXPECT_TRUE(got.ok()) << got.status();
    values.resize(layout->unpadded_numel());
    return values;
  }

  // Gathers both groups at `version` or later, as a worker does before computing the
  // gradients of a step: the scatters after it name the state they come from, so that
  // after a checkpoint load the servers take them (a gradient of the replaced state is
  // refused).
  void GatherAll(int64_t version) {
    Params("big", big, version);
    Params("tiny", tiny, version);
  }
};

// A client of job "test" that sends no gradients: an operator's `flatshard save`, say.
inline std::unique_ptr<Client> Operator(const TestCluster& cluster, absl::Duration timeout = absl::Seconds(20)) {
  auto connected = cluster.Connect({.job = "test", .timeout = timeout});
  EXPECT_TRUE(connected.ok()) << connected.status();
  return connected.ok() ? *std::move(connected) : nullptr;
}

// Checkpoint name -> its versions (group -> version), as `client` lists them.
inline std::map<std::string, std::map<std::string, int64_t>> ListedVersions(Client& client) {
  std::map<std::string, std::map<std::string, int64_t>> versions;
  auto listed = client.ListCheckpoints();
  EXPECT_TRUE(listed.ok()) << listed.status();
  if (listed.ok()) {
    for (const CheckpointEntry& entry : *listed) versions[entry.name] = entry.versions;
  }
  return versions;
}

// Runs `operation` on a thread and checks that it is still running after 300 ms (it
// waits for something, `what`), then runs `unblock` and returns the operation's outcome.
inline absl::Status MustWaitFor(const std::function<absl::Status()>& operation, const std::function<void()>& unblock,
                                const std::string& what) {
  std::atomic<bool> done = false;
  absl::Status status;
  std::thread running([&] {
    status = operation();
    done = true;
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(done) << "it did not wait for " << what << ": " << status;
  unblock();
  running.join();
  return status;
}

// Waits (up to 10 s) until no server of `cluster` lists a save or load in progress: a
// server lets go of a save whose wait ran out shortly before its client's deadline, which
// on a loaded machine can be just after. True once none does.
inline bool AwaitNoCheckpointInProgress(const TestCluster& cluster) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    bool busy = false;
    for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
      busy |= !status.ok() || status->checkpoints_in_progress_size() > 0;
    }
    if (!busy) return true;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_INTEGRATION_TRAINER_H_
