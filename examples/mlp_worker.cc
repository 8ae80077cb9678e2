// A training worker on flatshard: a two-layer MLP (16 -> 64 -> 1, ReLU) learning a
// synthetic regression task (a fixed random "teacher" network plus noise), forward and
// backward written out by hand. Each of the W workers computes the gradient of its own
// half of the batch; the servers average them and run AdamW.
//
//   mlp_worker --cluster=127.0.0.1:7070,127.0.0.1:7072 --worker_rank=0 --num_workers=2
#include <cmath>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/command_line.h"
#include "core/flat_buffer.h"
#include "flatshard/await.h"
#include "flatshard/client.h"

ABSL_FLAG(std::string, cluster, "127.0.0.1:7070", "servers' control addresses, rank order");
ABSL_FLAG(int, worker_rank, 0, "this worker's rank");
ABSL_FLAG(int, num_workers, 1, "workers in the job");
ABSL_FLAG(int, steps, 300, "optimizer steps");
ABSL_FLAG(int, batch, 64, "samples per worker per step");
ABSL_FLAG(std::string, job, "mlp-demo", "job name");
ABSL_FLAG(int, replicas, 1,
          "replica groups (hybrid sharding): worker w trains with replica group w % replicas");

namespace {

constexpr int kIn = 16;
constexpr int kHidden = 64;

// Synthetic task: y = teacher(x) + noise, the teacher a fixed random tanh network.
struct Teacher {
  std::vector<float> w1, w2;
  Teacher() {
    std::mt19937 rng(2024);
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(float{kIn}));
    for (int i = 0; i < 8 * kIn; ++i) w1.push_back(normal(rng));
    for (int i = 0; i < 8; ++i) w2.push_back(normal(rng));
  }
  float operator()(const float* x) const {
    float y = 0;
    for (int h = 0; h < 8; ++h) {
      float a = 0;
      for (int i = 0; i < kIn; ++i) a += w1[h * kIn + i] * x[i];
      y += w2[h] * std::tanh(a);
    }
    return y;
  }
};

int Fail(const absl::Status& status) {
  std::cerr << "mlp_worker: " << status << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mlp_worker --cluster=A0,A1,... --worker_rank=I --num_workers=W [flags]: trains a two-layer MLP on flatshard servers");
  flatshard::ParseCommandLineOrExit(argc, argv, "mlp_worker");
  flatshard::ClientOptions options;
  options.servers = absl::StrSplit(absl::GetFlag(FLAGS_cluster), ',', absl::SkipEmpty());
  options.worker_rank = absl::GetFlag(FLAGS_worker_rank);
  options.num_workers = absl::GetFlag(FLAGS_num_workers);
  options.job = absl::GetFlag(FLAGS_job);
  const int rank = options.worker_rank;
  auto client = flatshard::Client::Connect(options);
  if (!client.ok()) return Fail(client.status());
  if (auto st = (*client)->ConfigureJob({.replicas = absl::GetFlag(FLAGS_replicas)}); !st.ok()) return Fail(st);

  const flatshard::AdamOptions adamw{.lr = 1e-2, .weight_decay = 0.01, .decoupled_weight_decay = true};
  auto fc1 = (*client)->RegisterGroup(
      "fc1", {{"fc1.weight", {kHidden, kIn}}, {"fc1.bias", {kHidden}}}, 0, adamw);
  if (!fc1.ok()) return Fail(fc1.status());
  auto fc2 = (*client)->RegisterGroup("fc2", {{"fc2.weight", {1, kHidden}}, {"fc2.bias", {1}}}, 0, adamw);
  if (!fc2.ok()) return Fail(fc2.status());
  // Every worker initializes with the same seed: idempotent, and no worker can gather
  // before the values exist.
  for (const char* group : {"fc1", "fc2"}) {
    if (auto st = (*client)->InitGroupFromSeed(group, 7); !st.ok()) return Fail(st);
  }

  const flatshard::FlatLayout& l1 = **fc1;
  const flatshard::FlatLayout& l2 = **fc2;
  std::vector<float> p1(l1.padded_numel()), p2(l2.padded_numel());
  std::vector<float> g1(l1.padded_numel()), g2(l2.padded_numel());
  const Teacher teacher;
  const int batch = absl::GetFlag(FLAGS_batch);
  const int steps = absl::GetFlag(FLAGS_steps);
  std::vector<float> x(batch * kIn), y(batch), hidden(batch * kHidden), out(batch);
  const absl::Time start = absl::Now();

  for (int step = 0; step < steps; ++step) {
    // Gather both groups at once (prefetch), then wait (Await: small transfers are seen
    // the moment they complete).
    auto f1 = (*client)->Gather("fc1", step, flatshard::DType::kFloat32, flatshard::AsBytes(p1));
    auto f2 = (*client)->Gather("fc2", step, flatshard::DType::kFloat32, flatshard::AsBytes(p2));
    if (auto v = flatshard::Await(f1); !v.ok()) return Fail(v.status());
    if (auto v = flatshard::Await(f2); !v.ok()) return Fail(v.status());
    const float* w1 = flatshard::TensorView<float>(l1, absl::MakeSpan(p1), 0).data();
    const float* b1 = flatshard::TensorView<float>(l1, absl::MakeSpan(p1), 1).data();
    const float* w2 = flatshard::TensorView<float>(l2, absl::MakeSpan(p2), 0).data();
    const float b2 = flatshard::TensorView<float>(l2, absl::MakeSpan(p2), 1)[0];

    // This worker's half of the step's batch.
    std::mt19937 rng(static_cast<uint32_t>(step * 1000 + rank));
    std::normal_distribution<float> normal;
    for (float& v : x) v = normal(rng);
    for (int n = 0; n < batch; ++n) y[n] = teacher(&x[n * kIn]) + 0.01f * normal(rng);

    // Forward.
    double loss = 0;
    for (int n = 0; n < batch; ++n) {
      float o = b2;
      for (int h = 0; h < kHidden; ++h) {
        float a = b1[h];
        for (int i = 0; i < kIn; ++i) a += w1[h * kIn + i] * x[n * kIn + i];
        hidden[n * kHidden + h] = a > 0 ? a : 0;
        o += w2[h] * hidden[n * kHidden + h];
      }
      out[n] = o;
      loss += 0.5 * (o - y[n]) * (o - y[n]);
    }
    loss /= batch;

    // Backward of the mean loss, straight into the flat gradient buffers.
    std::fill(g1.begin(), g1.end(), 0.0f);
    std::fill(g2.begin(), g2.end(), 0.0f);
    float* gw1 = flatshard::TensorView<float>(l1, absl::MakeSpan(g1), 0).data();
    float* gb1 = flatshard::TensorView<float>(l1, absl::MakeSpan(g1), 1).data();
    float* gw2 = flatshard::TensorView<float>(l2, absl::MakeSpan(g2), 0).data();
    float* gb2 = flatshard::TensorView<float>(l2, absl::MakeSpan(g2), 1).data();
    for (int n = 0; n < batch; ++n) {
      const float d_out = (out[n] - y[n]) / batch;
      *gb2 += d_out;
      for (int h = 0; h < kHidden; ++h) {
        gw2[h] += d_out * hidden[n * kHidden + h];
        if (hidden[n * kHidden + h] <= 0) continue;
        const float d_a = d_out * w2[h];
        gb1[h] += d_a;
        for (int i = 0; i < kIn; ++i) gw1[h * kIn + i] += d_a * x[n * kIn + i];
      }
    }
    auto s1 = (*client)->Scatter("fc1", step, flatshard::DType::kFloat32, flatshard::AsBytes(g1));
    auto s2 = (*client)->Scatter("fc2", step, flatshard::DType::kFloat32, flatshard::AsBytes(g2));
    if (auto st = flatshard::Await(s1); !st.ok()) return Fail(st);
    if (auto st = flatshard::Await(s2); !st.ok()) return Fail(st);
    if (rank == 0 && (step % 25 == 0 || step == steps - 1)) {
      std::cout << "step " << step << "  loss " << loss << std::endl;
    }
  }
  if (auto v = (*client)->WaitVersion("fc1", steps); !v.ok()) return Fail(v.status());
  if (rank == 0) {
    std::cout << "worker 0: " << steps << " steps in "
              << absl::ToDoubleSeconds(absl::Now() - start) << " s" << std::endl;
  }
  return 0;
}
