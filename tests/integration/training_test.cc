// 3 server processes x 2 worker threads train several groups (one smaller than the server
// count, so some shards hold only padding) for 20 steps with mixed gather and scatter
// dtypes. The parameters must equal a single-process computation of the same math
// bit for bit. Hybrid sharding: 4 servers in 2 replica groups, 4 workers, the same.
// Also: InitGroup's shards, WaitVersions (a step's wait for its groups) and SetHyperparams
// of several groups (a learning-rate schedule's change).
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <stop_token>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "client/cluster_status.h"
#include "core/flat_buffer.h"
#include "core/float_bits.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"
#include "proto/flatshard.grpc.pb.h"
#include "tests/integration/gpu_worker.h"
#include "tests/integration/test_cluster.h"
#include "transport/data_protocol.h"
#if FLATSHARD_HAVE_CUDA
#include "kernels/cuda/nccl.h"
#endif

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using testing::DeviceBytes;
using testing::HaveGpu;
using testing::HaveNccl;
using testing::kNcclServers;
using testing::kNcclWorkers;
using testing::SetNcclHost;

constexpr int kWorkers = 2;  // unless a test says otherwise
constexpr int kSteps = 20;

struct GroupCase {
  std::string name;
  std::vector<TensorSpec> tensors;
  int64_t align;
  OptimizerOptions optimizer;
  DType scatter_dtype[2];  // by worker rank % 2
  DType gather_dtype;
};

std::vector<GroupCase> Cases() {
  return {
      {"big",
       {{"a.weight", {7, 5}, DType::kFloat32}, {"a.bias", {3}, DType::kFloat32}, {"b", {11}, DType::kFloat32}},
       4,
       AdamOptions{.lr = 1e-2, .weight_decay = 0.1},
       {DType::kFloat32, DType::kFloat32},
       DType::kFloat32},
      {"tiny",
       {{"scale", {2}, DType::kFloat32}},
       0,
       SgdOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true},
       {DType::kFloat32, DType::kFloat16},
       DType::kFloat32},
      {"mixed",
       {{"emb", {4, 4}, DType::kBFloat16}, {"norm", {}, DType::kFloat32}},
       0,
       AdamOptions{.lr = 5e-3, .weight_decay = 0.01, .amsgrad = true, .decoupled_weight_decay = true},
       {DType::kBFloat16, DType::kFloat32},
       DType::kBFloat16},
  };
}

// Worker w's gradient for `step`, in fp32 (deterministic).
std::vector<float> Gradient(const FlatLayout& layout, int group_index, int step, int worker) {
  std::mt19937 rng(static_cast<uint32_t>(group_index * 100000 + step * 10 + worker));
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> grad(layout.padded_numel(), 0.0f);
  for (const TensorPiece& piece : layout.MapRange(0, layout.padded_numel())) {
    for (int64_t k = 0; k < piece.numel; ++k) grad[piece.flat_offset + k] = normal(rng);
  }
  return grad;
}

std::vector<std::byte> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * DTypeSize(dtype));
  EXPECT_TRUE(kernels::cpu::Cast(DType::kFloat32, values.data(), dtype, bytes.data(),
                                 static_cast<int64_t>(values.size())).ok());
  return bytes;
}

std::vector<float> InitialValues(const FlatLayout& layout) {
  std::vector<float> flat(layout.padded_numel(), 0.0f);
  for (const TensorPiece& piece : layout.MapRange(0, layout.padded_numel())) {
    for (int64_t k = 0; k < piece.numel; ++k) {
      flat[piece.flat_offset + k] = 0.01f * static_cast<float>((piece.flat_offset + k) % 17) - 0.05f;
    }
  }
  return flat;
}

// The same math in one process: reduce in worker order, mean, optional clipping with
// the norm combined exactly as the servers do (per server: its shards in group-name
// order; then the servers in rank order), optimizer on the whole flat buffer
// (elementwise, so sharding cannot change a bit). With replica groups (hybrid sharding),
// each replica group's workers are summed in rank order, then the replica groups'
// partials in replica order, and the norm is one replica group's. `norms` gets each
// clipped step's total norm.
std::vector<std::vector<float>> Reference(const std::vector<GroupCase>& cases,
                                          const std::vector<const FlatLayout*>& layouts,
                                          const JobOptions& job, int workers, std::vector<double>& norms) {
  struct State {
    std::vector<float> params, m, v, v_max, grad;
  };
  std::vector<State> states;
  for (const FlatLayout* layout : layouts) {
    const size_t n = layout->padded_numel();
    states.push_back({InitialValues(*layout), std::vector<float>(n), std::vector<float>(n),
                      std::vector<float>(n), std::vector<float>(n)});
  }
  std::vector<size_t> name_order(cases.size());
  std::iota(name_order.begin(), name_order.end(), 0);
  std::sort(name_order.begin(), name_order.end(),
            [&](size_t a, size_t b) { return cases[a].name < cases[b].name; });
  for (int step = 0; step < kSteps; ++step) {
    for (size_t g = 0; g < cases.size(); ++g) {
      std::vector<float>& grad = states[g].grad;
      std::vector<float> partial(grad.size());
      for (int replica = 0; replica < job.replicas; ++replica) {
        for (int w = replica; w < workers; w += job.replicas) {
          const DType dtype = cases[g].scatter_dtype[w % 2];
          const std::vector<std::byte> bytes = Encode(Gradient(*layouts[g], static_cast<int>(g), step, w), dtype);
          if (w == replica) {
            EXPECT_TRUE(kernels::cpu::Cast(dtype, bytes.data(), DType::kFloat32, partial.data(), partial.size()).ok());
          } else {
            EXPECT_TRUE(kernels::cpu::Accumulate(dtype, bytes.data(), absl::MakeSpan(partial)).ok());
          }
        }
        if (replica == 0) {
          grad = partial;
        } else {
          EXPECT_TRUE(kernels::cpu::Accumulate(DType::kFloat32, partial.data(), absl::MakeSpan(grad)).ok());
        }
      }
      kernels::cpu::Scale(absl::MakeSpan(grad), 1.0f / static_cast<float>(workers));
    }
    if (job.max_grad_norm > 0) {
      const bool inf_norm = std::isinf(job.norm_type);
      double combined = 0.0;
      for (int rank = 0; rank < layouts[0]->num_shards(); ++rank) {
        double partial = 0.0;
        for (size_t g : name_order) {
          const int64_t shard = layouts[g]->shard_numel();
          const auto slice = absl::MakeConstSpan(states[g].grad).subspan(rank * shard, shard);
          partial = inf_norm ? std::max<double>(partial, kernels::cpu::MaxAbs(slice))
                             : partial + kernels::cpu::SquaredNorm(slice);
        }
        combined = inf_norm ? std::max(combined, partial) : combined + partial;
      }
      const double total = inf_norm ? combined : std::sqrt(combined);
      norms.push_back(total);
      const float coef = static_cast<float>(job.max_grad_norm / (total + 1e-6));
      EXPECT_LT(coef, 1.0f) << "the test should clip";
      if (coef < 1.0f) {
        for (State& state : states) kernels::cpu::Scale(absl::MakeSpan(state.grad), coef);
      }
    }
    for (size_t g = 0; g < cases.size(); ++g) {
      State& st = states[g];
      if (const auto* adam = std::get_if<AdamOptions>(&cases[g].optimizer)) {
        kernels::cpu::AdamStep({.lr = static_cast<float>(adam->lr), .beta1 = static_cast<float>(adam->beta1),
                                .beta2 = static_cast<float>(adam->beta2), .eps = static_cast<float>(adam->eps),
                                .weight_decay = static_cast<float>(adam->weight_decay), .amsgrad = adam->amsgrad,
                                .decoupled_weight_decay = adam->decoupled_weight_decay},
                               step + 1, absl::MakeSpan(st.params), st.grad, absl::MakeSpan(st.m),
                               absl::MakeSpan(st.v), absl::MakeSpan(st.v_max));
      } else {
        const auto& sgd = std::get<SgdOptions>(cases[g].optimizer);
        kernels::cpu::SgdStep({.lr = static_cast<float>(sgd.lr), .momentum = static_cast<float>(sgd.momentum),
                               .dampening = static_cast<float>(sgd.dampening),
                               .weight_decay = static_cast<float>(sgd.weight_decay), .nesterov = sgd.nesterov},
                              step == 0, absl::MakeSpan(st.params), st.grad, absl::MakeSpan(st.m));
      }
    }
  }
  std::vector<std::vector<float>> params;
  for (State& state : states) params.push_back(std::move(state.params));
  return params;
}

void RunWorker(const testing::TestCluster& cluster, int rank, int workers, const std::vector<GroupCase>& cases,
               bool device_buffers, DevicePlane plane) {
  auto client = cluster.Connect(rank, workers, "test", plane);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<const FlatLayout*> layouts;
  for (const GroupCase& c : cases) {
    auto layout = (*client)->RegisterGroup(c.name, c.tensors, c.align, c.optimizer);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layouts.push_back(*layout);
  }
  for (int step = 0; step < kSteps; ++step) {
    for (size_t g = 0; g < cases.size(); ++g) {
      std::vector<std::byte> params(layouts[g]->padded_numel() * DTypeSize(cases[g].gather_dtype));
      const std::vector<std::byte> grad =
          Encode(Gradient(*layouts[g], static_cast<int>(g), step, rank), cases[g].scatter_dtype[rank % 2]);
      if (device_buffers) {
        DeviceBytes device_params(params.size()), device_grad(grad.size());
        auto version = (*client)->Gather(cases[g].name, step, cases[g].gather_dtype, device_params.span()).get();
        ASSERT_TRUE(version.ok()) << version.status();
        ASSERT_GE(*version, step);
        device_grad.Upload(grad);
        const absl::Status sent = (*client)->Scatter(cases[g].name, step, cases[g].scatter_dtype[rank % 2],
                                                     device_grad.span()).get();
        ASSERT_TRUE(sent.ok()) << sent;
        continue;
      }
      auto version = (*client)->Gather(cases[g].name, step, cases[g].gather_dtype, absl::MakeSpan(params)).get();
      ASSERT_TRUE(version.ok()) << version.status();
      ASSERT_GE(*version, step);
      const absl::Status sent = (*client)->Scatter(cases[g].name, step, cases[g].scatter_dtype[rank % 2],
                                                   absl::MakeConstSpan(grad)).get();
      ASSERT_TRUE(sent.ok()) << sent;
    }
  }
}

// `memory[i]`: server i's --memory; `device_buffers`: the workers gather into and scatter
// from GPU buffers, over `plane` where the servers keep their shards on the GPU.
void TrainAndCompare(const JobOptions& job,
                     const std::vector<std::string>& memory = {"host", "host", "host"},
                     bool device_buffers = false, DevicePlane plane = DevicePlane::kAuto,
                     int workers = kWorkers) {
  std::vector<std::vector<std::string>> args;
  for (const std::string& tier : memory) args.push_back({"--memory=" + tier});
  if (plane == DevicePlane::kNccl) SetNcclHost(kNcclServers);
  testing::TestCluster cluster(static_cast<int>(memory.size()), "s3cret-token", ::testing::TempDir(), "", args);
  if (plane == DevicePlane::kNccl) SetNcclHost(kNcclWorkers);
  const std::vector<GroupCase> cases = Cases();
  auto setup = cluster.Connect(0, workers, "test", plane);
  ASSERT_TRUE(setup.ok()) << setup.status();
  ASSERT_TRUE((*setup)->ConfigureJob(job).ok());
  std::vector<const FlatLayout*> layouts;
  for (const GroupCase& c : cases) {
    auto layout = (*setup)->RegisterGroup(c.name, c.tensors, c.align, c.optimizer);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ASSERT_TRUE((*setup)->InitGroup(c.name, InitialValues(**layout)).ok());
    layouts.push_back(*layout);
  }
  if (layouts[1]->num_shards() == 3) {  // 3 servers, or replica groups of 3
    EXPECT_EQ(layouts[1]->shard_numel(), 1);  // "tiny": shard 2 holds padding only
    EXPECT_EQ(layouts[1]->shard_padding(2), 1);
  }

  std::vector<std::thread> threads;
  for (int rank = 0; rank < workers; ++rank) {
    threads.emplace_back([&, rank] { RunWorker(cluster, rank, workers, cases, device_buffers, plane); });
  }
  for (std::thread& thread : threads) thread.join();
  if (::testing::Test::HasFatalFailure()) return;

  std::vector<double> norms;
  const std::vector<std::vector<float>> reference = Reference(cases, layouts, job, workers, norms);
  // Each step's gradient norm, as the servers combined it: the reference's, bit for bit
  // on the CPU tiers; a device server's squared norm sums in another order, to double
  // rounding (kernels/cuda/kernels.h; seen on an H100: 1 ulp).
  if (job.max_grad_norm > 0) {
    ASSERT_EQ(norms.size(), static_cast<size_t>(kSteps));
    const bool gpu_norms = std::ranges::find(memory, "device") != memory.end();
    for (int step = 0; step < kSteps; ++step) {
      const absl::StatusOr<double> norm = (*setup)->GradNorm(step);
      ASSERT_TRUE(norm.ok()) << norm.status();
      if (gpu_norms) {
        EXPECT_NEAR(*norm, norms[step], 1e-13 * norms[step]) << "step " << step;
      } else {
        EXPECT_EQ(std::bit_cast<uint64_t>(*norm), std::bit_cast<uint64_t>(norms[step])) << "step " << step;
      }
    }
  } else {
    EXPECT_TRUE(absl::IsInvalidArgument((*setup)->GradNorm(0).status()));
  }
  for (size_t g = 0; g < cases.size(); ++g) {
    ASSERT_EQ(*(*setup)->WaitVersion(cases[g].name, kSteps), kSteps);
    const std::vector<float>& expected = reference[g];
    std::vector<float> actual(layouts[g]->padded_numel(), -1.0f);
    auto version = (*setup)->Gather(cases[g].name, kSteps, DType::kFloat32, AsBytes(actual)).get();
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(*version, kSteps);
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(actual[i]), std::bit_cast<uint32_t>(expected[i]))
          << cases[g].name << " element " << i << ": " << actual[i] << " vs " << expected[i];
    }
    // Low-precision gathers are exactly the cast of the fp32 master.
    std::vector<uint16_t> bf16(layouts[g]->padded_numel());
    ASSERT_TRUE((*setup)->Gather(cases[g].name, kSteps, DType::kBFloat16, AsBytes(bf16)).get().ok());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_EQ(bf16[i], FloatToBFloat16Bits(expected[i])) << cases[g].name << " element " << i;
    }
    if (device_buffers) {  // and the same bytes through the device path
      DeviceBytes device(bf16.size() * sizeof(uint16_t));
      ASSERT_TRUE((*setup)->Gather(cases[g].name, kSteps, DType::kBFloat16, device.span()).get().ok());
      std::vector<uint16_t> via_device(bf16.size());
      device.Download(AsBytes(via_device));
      EXPECT_EQ(via_device, bf16) << cases[g].name;
    }
  }
  // Every replica group holds the same bits: gathered through a worker of each other one.
  for (int replica = 1; replica < job.replicas; ++replica) {
    auto other = cluster.Connect(replica, workers, "test", plane);
    ASSERT_TRUE(other.ok()) << other.status();
    for (size_t g = 0; g < cases.size(); ++g) {
      ASSERT_TRUE((*other)->RegisterGroup(cases[g].name, cases[g].tensors, cases[g].align, cases[g].optimizer).ok());
      std::vector<float> actual(layouts[g]->padded_numel(), -1.0f);
      auto version = (*other)->Gather(cases[g].name, kSteps, DType::kFloat32, AsBytes(actual)).get();
      ASSERT_TRUE(version.ok()) << version.status();
      for (size_t i = 0; i < actual.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(actual[i]), std::bit_cast<uint32_t>(reference[g][i]))
            << cases[g].name << " element " << i << " in replica group " << replica;
      }
    }
  }
  if (device_buffers) {
    // Every group at once: over NCCL each transfer in flight has a link of its own
    // (client/link_pool.h), so these run side by side.
    std::vector<std::unique_ptr<DeviceBytes>> buffers;
    std::vector<std::future<absl::StatusOr<int64_t>>> pending;
    for (size_t g = 0; g < cases.size(); ++g) {
      buffers.push_back(std::make_unique<DeviceBytes>(layouts[g]->padded_numel() * sizeof(uint16_t)));
      pending.push_back((*setup)->Gather(cases[g].name, kSteps, DType::kBFloat16, buffers.back()->span()));
    }
    for (size_t g = 0; g < cases.size(); ++g) {
      auto version = pending[g].get();
      ASSERT_TRUE(version.ok()) << cases[g].name << ": " << version.status();
      std::vector<uint16_t> bf16(layouts[g]->padded_numel());
      buffers[g]->Download(AsBytes(bf16));
      for (size_t i = 0; i < reference[g].size(); ++i) {
        ASSERT_EQ(bf16[i], FloatToBFloat16Bits(reference[g][i])) << cases[g].name << " element " << i;
      }
    }
  }
  if (device_buffers) {
    const bool nccl = plane == DevicePlane::kNccl;
    std::vector<std::string> planes;
    for (const std::string& tier : memory) {
      planes.push_back(tier != "device" ? "tcp" : nccl ? "nccl" : "cuda-ipc");
    }
    EXPECT_EQ((*setup)->DataPlanes(), planes);
    // The bytes really went where the planes say, to device servers only.
    const auto statuses = FetchClusterStatus(
        {.servers = cluster.addresses(), .token = cluster.token(), .timeout = absl::Seconds(10)});
    for (size_t i = 0; i < memory.size(); ++i) {
      ASSERT_TRUE(statuses[i].ok()) << statuses[i].status();
      const v1::ServerStatus& s = *statuses[i];
      const int64_t gpu_scatters = nccl ? s.nccl_scatters() : s.ipc_scatters();
      const int64_t gpu_gathers = nccl ? s.nccl_gathers() : s.ipc_gathers();
      const int64_t other_plane = nccl ? s.ipc_scatters() + s.ipc_gathers() : s.nccl_scatters() + s.nccl_gathers();
      EXPECT_EQ(other_plane, 0) << i;
      if (memory[i] == "device") {
        EXPECT_EQ(gpu_scatters, workers * kSteps * static_cast<int64_t>(cases.size())) << i;
        EXPECT_GT(gpu_gathers, 0) << i;
      } else {
        EXPECT_EQ(gpu_scatters + gpu_gathers, 0) << i;
      }
    }
  }
}

TEST(TrainingIntegrationTest, ThreeServersTwoWorkersMatchSingleProcessBitwise) {
  TrainAndCompare({});
}

TEST(TrainingIntegrationTest, ClippingByGlobalL2NormAcrossGroupsAndServers) {
  TrainAndCompare({.max_grad_norm = 0.3});
}

TEST(TrainingIntegrationTest, ClippingByGlobalInfNorm) {
  TrainAndCompare({.max_grad_norm = 0.2, .norm_type = std::numeric_limits<double>::infinity()});
}

// HYBRID_SHARD: 6 servers in 2 replica groups of 3, 4 workers (2 per replica group).
// Each worker moves its buffers with its own replica group only, the servers exchange the
// replica groups' partial sums, and clipping takes one replica group's norm: the
// parameters equal the reference bit for bit in both replica groups.
TEST(TrainingIntegrationTest, HybridShardingReplicaGroupsMatchTheReferenceBitwise) {
  const std::vector<std::string> six_hosts(6, "host");
  TrainAndCompare({.replicas = 2}, six_hosts, false, DevicePlane::kAuto, /*workers=*/4);
  TrainAndCompare({.max_grad_norm = 0.3, .replicas = 2}, six_hosts, false, DevicePlane::kAuto, 4);
  // 3 replica groups of 2: three partials, whose fp32 sum depends on the order.
  TrainAndCompare({.max_grad_norm = 0.3, .replicas = 3}, six_hosts, false, DevicePlane::kAuto, 6);
}

// InitGroup sends each server its shard straight from the caller's buffer: unpadded
// values (the padding a shard lacks goes as zeros, down to a shard of padding only) and
// padded ones (whatever their padding holds) land alike, in every replica group.
TEST(InitGroupTest, UnpaddedAndPaddedValuesLandAlikeOnEveryShard) {
  for (const int replicas : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(replicas, " replica group(s)"));
    testing::TestCluster cluster(3 * replicas, "tok", ::testing::TempDir());
    std::vector<std::unique_ptr<Client>> workers;  // worker r gathers from replica group r
    for (int rank = 0; rank < replicas; ++rank) {
      auto client = cluster.Connect(rank, replicas);
      ASSERT_TRUE(client.ok()) << client.status();
      workers.push_back(*std::move(client));
    }
    ASSERT_TRUE(workers[0]->ConfigureJob({.replicas = replicas}).ok());
    // 4 elements over 3 shards of 2: shard 2 holds padding only. Two tensors with a gap
    // of alignment padding between them: shard 2 holds an element and padding.
    const std::vector<std::vector<TensorSpec>> groups = {
        {{"w", {4}, DType::kFloat32}},
        {{"a", {3}, DType::kFloat32}, {"b", {1}, DType::kFloat32}},
    };
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::string name = absl::StrCat("g", g);
      const int64_t align = g == 0 ? 0 : 4;
      auto layout = workers[0]->RegisterGroup(name, groups[g], align, SgdOptions{.lr = 0.1});
      ASSERT_TRUE(layout.ok()) << layout.status();
      for (int rank = 1; rank < replicas; ++rank) {
        ASSERT_TRUE(workers[rank]->RegisterGroup(name, groups[g], align, SgdOptions{.lr = 0.1}).ok());
      }
      const FlatLayout& l = **layout;
      ASSERT_EQ(l.shard_padding(2), g == 0 ? l.shard_numel() : 1);
      ASSERT_EQ(l.unpadded_numel(), g == 0 ? 4 : 5);
      // What a gather must give: the values at the tensors' elements, zeros elsewhere.
      std::vector<float> expected(l.padded_numel(), 0.0f);
      for (const TensorPiece& piece : l.MapRange(0, l.padded_numel())) {
        for (int64_t k = 0; k < piece.numel; ++k) {
          expected[piece.flat_offset + k] = 1.5f + static_cast<float>(piece.flat_offset + k);
        }
      }
      std::vector<float> unpadded(expected.begin(), expected.begin() + l.unpadded_numel());
      std::vector<float> padded = expected;
      for (float& value : padded) {
        if (value == 0.0f) value = std::numeric_limits<float>::quiet_NaN();  // ignored
      }
      for (const std::vector<float>* values : {&unpadded, &padded}) {
        SCOPED_TRACE(values == &padded ? "padded" : "unpadded");
        ASSERT_TRUE(workers[0]->InitGroup(name, *values).ok());
        for (int rank = 0; rank < replicas; ++rank) {
          std::vector<float> params(l.padded_numel(), -1.0f);
          ASSERT_EQ(workers[rank]->Gather(name, 0, DType::kFloat32, AsBytes(params)).get().value_or(-1), 0);
          EXPECT_EQ(params, expected);
        }
      }
    }
  }
}

// WaitVersions waits for a step's groups in one call per server: it returns once the last
// of them reaches the version on both servers, with each group's version; a name the
// servers do not have is refused at once, naming it, rather than after the others' wait;
// a stopped wait says how many groups it waited for and names the first three; a server
// that goes away ends the wait at once.
TEST(WaitVersionsTest, ReturnsOnceEveryGroupIsThere) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  auto worker = cluster.Connect(0, 1);
  ASSERT_TRUE(worker.ok()) << worker.status();
  Client& client = **worker;
  ASSERT_TRUE(client.ConfigureJob({}).ok());
  std::vector<float> grad;
  for (const char* name : {"a", "b", "c", "d"}) {
    auto layout = client.RegisterGroup(name, {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
    ASSERT_TRUE(layout.ok()) << layout.status();
    grad.assign((*layout)->padded_numel(), 1.0f);
  }
  EXPECT_EQ(client.WaitVersions({"a", "b", "c"}, 0).value_or(std::vector<int64_t>{}),
            (std::vector<int64_t>{0, 0, 0}));

  auto both = std::async(std::launch::async, [&] { return client.WaitVersions({"a", "b"}, 1); });
  ASSERT_TRUE(client.Scatter("a", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  ASSERT_EQ(client.WaitVersion("a", 1).value_or(-1), 1);
  EXPECT_EQ(both.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout) << "'b' is still at 0";
  ASSERT_TRUE(client.Scatter("b", 0, DType::kFloat32, AsBytes(grad)).get().ok());
  EXPECT_EQ(both.get().value_or(std::vector<int64_t>{}), (std::vector<int64_t>{1, 1}));
  // Versions as they are: "c" never stepped.
  EXPECT_EQ(client.WaitVersions({"c", "a"}, 0).value_or(std::vector<int64_t>{}), (std::vector<int64_t>{0, 1}));

  const absl::Time start = absl::Now();
  const absl::StatusOr<std::vector<int64_t>> missing = client.WaitVersions({"c", "nope"}, 5);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("'nope'"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "refused before waiting for 'c'";
  EXPECT_EQ(client.WaitVersions({}, 0).status().code(), absl::StatusCode::kInvalidArgument);

  std::stop_source stop;
  auto stopped = std::async(std::launch::async,
                            [&] { return client.WaitVersions({"a", "b", "c", "d"}, 2, stop.get_token()); });
  absl::SleepFor(absl::Milliseconds(200));  // no step comes
  stop.request_stop();
  const absl::StatusOr<std::vector<int64_t>> waited = stopped.get();
  EXPECT_TRUE(absl::IsCancelled(waited.status())) << waited.status();
  EXPECT_EQ(waited.status().message(), "the wait for version 2 of 4 groups ('a', 'b', 'c', ...) was stopped");

  // The servers are waited for at once: one that goes away ends the call then, not once
  // the other's wait runs into the client's 30 s timeout.
  auto orphaned = std::async(std::launch::async, [&] { return client.WaitVersions({"a", "b"}, 2); });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time killed = absl::Now();
  cluster.Signal(1, SIGKILL);
  const absl::StatusOr<std::vector<int64_t>> lost = orphaned.get();
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
  EXPECT_THAT(std::string(lost.status().message()), HasSubstr(cluster.addresses()[1])) << lost.status();
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
}

// A worker whose gradients completed a step (every server answered them with the next
// version) waits for that version without asking the servers: it returns with both
// servers stopped (SIGSTOP). A worker whose gradient waited for another's asks them (a
// stop ends its wait), and so does a wait for any other version.
TEST(WaitVersionsTest, AStepThisClientsGradientsCompletedNeedsNoCall) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  std::vector<std::unique_ptr<Client>> workers;
  for (int rank = 0; rank < 2; ++rank) {
    auto worker = cluster.Connect(rank, 2);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(*std::move(worker));
  }
  ASSERT_TRUE(workers[0]->ConfigureJob({}).ok());
  std::vector<float> grad;
  for (const std::unique_ptr<Client>& worker : workers) {
    for (const char* name : {"a", "b"}) {
      auto layout = worker->RegisterGroup(name, {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.5});
      ASSERT_TRUE(layout.ok()) << layout.status();
      grad.assign((*layout)->padded_numel(), 1.0f);
    }
  }
  const std::vector<absl::Span<const std::byte>> grads(2, AsBytes(grad));
  for (const std::unique_ptr<Client>& worker : workers) {  // worker 1's gradients complete the step
    for (auto& scattered : worker->ScatterGroups({"a", "b"}, 0, DType::kFloat32, grads)) {
      ASSERT_TRUE(scattered.get().ok());
    }
  }
  ASSERT_TRUE(cluster.Pause(0) && cluster.Pause(1));
  absl::Cleanup resume = [&] {
    cluster.Resume(0);
    cluster.Resume(1);
  };
  auto stopped_wait = [](Client& worker, int64_t version) {
    std::stop_source stop;
    auto waited =
        std::async(std::launch::async, [&] { return worker.WaitVersions({"a", "b"}, version, stop.get_token()); });
    if (waited.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout) stop.request_stop();
    return waited.get();
  };
  EXPECT_EQ(stopped_wait(*workers[1], 1).value_or(std::vector<int64_t>{}), (std::vector<int64_t>{1, 1}));
  for (const auto& [worker, version] : {std::pair{0, 1}, std::pair{1, 2}, std::pair{1, 0}}) {
    SCOPED_TRACE(absl::StrCat("worker ", worker, ", version ", version));
    const absl::StatusOr<std::vector<int64_t>> asked = stopped_wait(*workers[worker], version);
    EXPECT_TRUE(absl::IsCancelled(asked.status())) << asked.status();
  }
  std::move(resume).Invoke();
  EXPECT_EQ(workers[0]->WaitVersions({"a", "b"}, 1).value_or(std::vector<int64_t>{}), (std::vector<int64_t>{1, 1}));
}

// SetHyperparams for several groups changes each one's settings from the next step on,
// on every server, in one call; a batch that names a group the servers do not have, a
// setting out of range or another optimizer kind changes none of its groups, and the
// refusal names the group.
TEST(SetHyperparamsTest, ChangesEveryGroupNamedOrNone) {
  testing::TestCluster cluster(2, "tok", ::testing::TempDir());
  auto worker = cluster.Connect(0, 1);
  ASSERT_TRUE(worker.ok()) << worker.status();
  Client& client = **worker;
  ASSERT_TRUE(client.ConfigureJob({.reduce_mean = false}).ok());
  std::vector<float> ones;
  for (const char* name : {"a", "b"}) {
    auto layout = client.RegisterGroup(name, {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0});
    ASSERT_TRUE(layout.ok()) << layout.status();
    ones.assign((*layout)->padded_numel(), 1.0f);
    ASSERT_TRUE(client.InitGroup(name, std::vector<float>(ones.size(), 0.0f)).ok());
  }
  ASSERT_TRUE(client.RegisterGroup("f", {{"w", {10}, DType::kFloat32}}, 0, FrozenOptions{}).ok());
  int64_t step = 0;
  // One step of both groups, a gradient of 1 everywhere (padding too).
  auto step_both = [&] {
    for (const char* name : {"a", "b"}) {
      ASSERT_TRUE(client.Scatter(name, step, DType::kFloat32, AsBytes(ones)).get().ok());
    }
    ++step;
  };
  // The values a group's elements hold after the last step: one, as every element (and
  // server) starts at 0 and takes the same gradients.
  auto value_of = [&](const char* name) {
    std::vector<float> params(ones.size());
    EXPECT_EQ(client.Gather(name, step, DType::kFloat32, AsBytes(params)).get().value_or(-1), step);
    return std::set<float>(params.begin(), params.end());
  };

  ASSERT_TRUE(client.SetHyperparams({{"a", SgdOptions{.lr = 0.25}}, {"b", SgdOptions{.lr = 0.5}}}).ok());
  step_both();
  EXPECT_EQ(value_of("a"), std::set<float>{-0.25f});
  EXPECT_EQ(value_of("b"), std::set<float>{-0.5f});

  const std::vector<std::pair<std::vector<GroupOptimizer>, std::pair<absl::StatusCode, std::string>>> refused = {
      {{{"a", SgdOptions{.lr = 2}}, {"nope", SgdOptions{.lr = 2}}}, {absl::StatusCode::kNotFound, "'nope'"}},
      {{{"a", SgdOptions{.lr = 2}}, {"b", SgdOptions{.lr = -1}}}, {absl::StatusCode::kInvalidArgument, "group 'b': "}},
      {{{"a", SgdOptions{.lr = 2}}, {"f", SgdOptions{.lr = 2}}},
       {absl::StatusCode::kFailedPrecondition, "group 'f': optimizer is frozen"}},
      {{{"a", SgdOptions{.lr = 2}}, {"b", AdamOptions{}}}, {absl::StatusCode::kFailedPrecondition, "group 'b': "}},
  };
  for (const auto& [groups, expected] : refused) {
    const absl::Status status = client.SetHyperparams(groups);
    EXPECT_EQ(status.code(), expected.first) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(expected.second)) << status;
  }
  EXPECT_EQ(client.SetHyperparams(std::vector<GroupOptimizer>{}).code(), absl::StatusCode::kInvalidArgument);
  step_both();  // with the settings of the batch that went through
  EXPECT_EQ(value_of("a"), std::set<float>{-0.5f});
  EXPECT_EQ(value_of("b"), std::set<float>{-1.0f});
}

// The SetHyperparams RPC, for gRPC clients other than this library (whose Client sends
// the request on its data connections), applies the same rule on the server it reaches.
TEST(SetHyperparamsTest, TheRpcChangesTheGroupsOfTheServerItReaches) {
  testing::TestCluster cluster(1, "tok", ::testing::TempDir());
  auto worker = cluster.Connect(0, 1);
  ASSERT_TRUE(worker.ok()) << worker.status();
  Client& client = **worker;
  ASSERT_TRUE(client.ConfigureJob({.reduce_mean = false}).ok());
  auto layout = client.RegisterGroup("a", {{"w", {10}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> values((*layout)->padded_numel(), 0.0f);
  ASSERT_TRUE(client.InitGroup("a", values).ok());
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()));
  auto call = [&](const std::string& group, double lr) {
    v1::SetHyperparamsRequest request;
    request.set_job(client.options().job);
    v1::GroupOptimizer* entry = request.add_groups();
    entry->set_group(group);
    entry->mutable_optimizer()->mutable_sgd()->set_lr(lr);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + cluster.token());
    v1::SetHyperparamsResponse response;
    return stub->SetHyperparams(&ctx, request, &response);
  };
  const grpc::Status unknown = call("nope", 0.5);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();
  EXPECT_THAT(unknown.error_message(), HasSubstr("'nope'"));
  EXPECT_EQ(call("a", -1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(call("a", 0.25).ok());
  const std::vector<float> ones(values.size(), 1.0f);
  ASSERT_TRUE(client.Scatter("a", 0, DType::kFloat32, AsBytes(ones)).get().ok());
  ASSERT_EQ(client.Gather("a", 1, DType::kFloat32, AsBytes(values)).get().value_or(-1), 1);
  EXPECT_EQ(std::set<float>(values.begin(), values.end()), std::set<float>{-0.25f});
}

// The GPU tiers run the same element code as the CPU (kernels/cuda/kernels.h), so the
// servers' results stay bitwise equal to the single-process CPU reference.
TEST(TrainingIntegrationTest, DeviceMemoryTierMatchesSingleProcessBitwise) {
  if (!HaveGpu()) GTEST_SKIP() << "--memory=device needs a CUDA build and a CUDA device";
  TrainAndCompare({}, {"device", "device", "device"});
  TrainAndCompare({.max_grad_norm = 0.3}, {"device", "device", "device"});
}

TEST(TrainingIntegrationTest, PinnedMemoryTierMatchesSingleProcessBitwise) {
  if (!HaveGpu()) GTEST_SKIP() << "--memory=pinned needs a CUDA build and a CUDA device";
  TrainAndCompare({.max_grad_norm = 0.2, .norm_type = std::numeric_limits<double>::infinity()},
                  {"pinned", "pinned", "pinned"});
}

// GPU workers: CUDA IPC with the servers on their GPU, host staging + TCP with the
// others, in one transfer; still bitwise equal to the CPU reference.
TEST(TrainingIntegrationTest, GpuWorkersOverCudaIpcMatchSingleProcessBitwise) {
  if (!HaveGpu()) GTEST_SKIP() << "CUDA IPC needs a CUDA build and a CUDA device";
  TrainAndCompare({}, {"device", "device", "device"}, /*device_buffers=*/true);
  TrainAndCompare({.max_grad_norm = 0.3}, {"device", "host", "pinned"}, /*device_buffers=*/true);
}

TEST(TrainingIntegrationTest, BadCudaIpcRequestsAreRefusedAndTheServerKeepsServing) {
  if (!HaveGpu()) GTEST_SKIP() << "CUDA IPC needs a CUDA build and a CUDA device";
  testing::TestCluster cluster(2, "tok", ::testing::TempDir(), "", {{"--memory=device"}, {"--memory=host"}});
  auto client = cluster.Connect(0, 1);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  auto layout = (*client)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{});
  ASSERT_TRUE(layout.ok()) << layout.status();
  // Raw kIpcGather requests on the data plane, each on a fresh connection.
  auto call = [&](int server, const transport::IpcTarget& target, size_t target_bytes) {
    auto conn = cluster.RawDataConnection(server);
    if (!conn.ok()) return conn.status();
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(transport::DataOp::kIpcGather);
    header.dtype = static_cast<uint8_t>(DType::kFloat32);
    header.timeout_ms = 1000;
    absl::Status sent = transport::SendRequest(
        **conn, header, "test", "g",
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), target_bytes));
    if (!sent.ok()) return sent;
    auto response = transport::RecvResponse(**conn, {});
    return response.ok() ? response->status : response.status();
  };
  transport::IpcTarget target;
  std::memset(target.handle, 0x5a, sizeof(target.handle));  // no such allocation
  target.bytes = (*layout)->shard_numel() * 4;
  const absl::Status garbage = call(0, target, sizeof(target));
  EXPECT_EQ(garbage.code(), absl::StatusCode::kInvalidArgument) << garbage;
  EXPECT_NE(garbage.message().find("IPC handle"), std::string::npos) << garbage;
  target.bytes = 12;
  EXPECT_EQ(call(0, target, sizeof(target)).code(), absl::StatusCode::kInvalidArgument);
  target.bytes = (*layout)->shard_numel() * 4;
  EXPECT_EQ(call(0, target, 40).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status host_server = call(1, target, sizeof(target));
  EXPECT_EQ(host_server.code(), absl::StatusCode::kFailedPrecondition) << host_server;
  // Both servers still serve, over either plane.
  DeviceBytes device((*layout)->padded_numel() * 4);
  EXPECT_TRUE((*client)->Gather("g", 0, DType::kFloat32, device.span()).get().ok());
  std::vector<float> host((*layout)->padded_numel());
  EXPECT_TRUE((*client)->Gather("g", 0, DType::kFloat32, AsBytes(host)).get().ok());
}

// GPU workers and --memory=device servers over NCCL (as between nodes, see
// SetNcclHost), with a host server in the mix; still bitwise equal to the CPU reference.
TEST(TrainingIntegrationTest, GpuWorkersOverNcclMatchSingleProcessBitwise) {
  if (!HaveGpu()) GTEST_SKIP() << "NCCL needs a CUDA build and a CUDA device";
  if (!HaveNccl()) GTEST_SKIP() << "NCCL does not load here (set FLATSHARD_NCCL_LIBRARY)";
  TrainAndCompare({}, {"device", "device", "device"}, /*device_buffers=*/true, DevicePlane::kNccl);
  TrainAndCompare({.max_grad_norm = 0.3}, {"device", "host", "device"}, /*device_buffers=*/true,
                  DevicePlane::kNccl);
}

#if FLATSHARD_HAVE_CUDA
// A worker of job "test" that speaks the NCCL plane to server 0 of `cluster` by hand, for
// group "g" of `shard_bytes` per server: it opens channels (the OpenNcclChannel call) and
// begins requests (sends one and reads its ready answer), then does what a test asks of
// its NCCL, or nothing.
class HandNcclWorker {
 public:
  HandNcclWorker(const testing::TestCluster& cluster, uint64_t shard_bytes)
      : stub_(v1::Flatshard::NewStub(
            grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()))),
        token_(cluster.token()),
        shard_bytes_(shard_bytes) {}

  absl::StatusOr<uint64_t> Open(const std::string& unique_id) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token_);
    v1::OpenNcclChannelRequest request;
    request.set_unique_id(unique_id);
    v1::OpenNcclChannelResponse response;
    grpc::Status status = stub_->OpenNcclChannel(&ctx, request, &response);
    if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    return response.channel();
  }

  // The ready answer's status; `version`: a gather's least version, a scatter's step.
  absl::Status Begin(transport::Connection& conn, transport::DataOp op, uint64_t channel, int64_t version = 0) const {
    transport::RequestHeader header;
    header.op = static_cast<uint8_t>(op);
    header.version = version;
    header.timeout_ms = 10000;
    const transport::NcclTarget target{channel, shard_bytes_};
    FLATSHARD_RETURN_IF_ERROR(transport::SendRequest(
        conn, header, "test", "g", absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&target), sizeof(target))));
    FLATSHARD_ASSIGN_OR_RETURN(transport::Response ready, transport::RecvResponse(conn, {}));
    return ready.status;
  }

 private:
  std::unique_ptr<v1::Flatshard::Stub> stub_;
  std::string token_;
  uint64_t shard_bytes_;
};

// One --memory=device server with job "test" (1 worker) and group "g" (SGD, lr 1), a TCP
// client of worker 0, and a HandNcclWorker to the server.
class TrainingHandNcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "NCCL needs a CUDA build and a CUDA device";
    if (!HaveNccl()) GTEST_SKIP() << "NCCL does not load here (set FLATSHARD_NCCL_LIBRARY)";
  }

  // Starts the server with --nccl_timeout=`nccl_timeout`.
  void Start(const std::string& nccl_timeout) {
    SetNcclHost(kNcclServers);
    cluster_ = std::make_unique<testing::TestCluster>(
        1, "tok", ::testing::TempDir(), "",
        std::vector<std::vector<std::string>>{{"--memory=device", "--nccl_timeout=" + nccl_timeout}});
    SetNcclHost(kNcclWorkers);
    auto client = cluster_->Connect(0, 1);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    ASSERT_TRUE(client_->ConfigureJob({}).ok());
    auto layout = client_->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{.lr = 1.0});
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    worker_ = std::make_unique<HandNcclWorker>(*cluster_, layout_->shard_numel() * 4);
  }

  // A channel the server joins with this process's communicator as the worker's rank.
  absl::StatusOr<std::pair<uint64_t, std::unique_ptr<kernels::cuda::NcclCommunicator>>> Joined() {
    FLATSHARD_ASSIGN_OR_RETURN(const std::string unique_id, kernels::cuda::NcclCommunicator::NewUniqueId());
    FLATSHARD_ASSIGN_OR_RETURN(const uint64_t channel, worker_->Open(unique_id));
    FLATSHARD_ASSIGN_OR_RETURN(auto comm, kernels::cuda::NcclCommunicator::Create(unique_id, 2, 1, absl::Seconds(20)));
    return std::make_pair(channel, std::move(comm));
  }

  // Worker 0's step 0 over TCP, a gradient of ones; OK, or the first refusal that is not
  // "already being received" (retried until `patience` runs out).
  absl::Status ScatterStep0(absl::Duration patience) {
    std::vector<float> grad(layout_->padded_numel(), 1.0f);
    const absl::Time deadline = absl::Now() + patience;
    for (;;) {
      const absl::Status sent = client_->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get();
      if (!absl::IsFailedPrecondition(sent) || absl::Now() > deadline) return sent;
      EXPECT_THAT(std::string(sent.message()), HasSubstr("already being received"));
      absl::SleepFor(absl::Milliseconds(50));
    }
  }

  // Version 1 holds step 0 applied once: 0 - lr * 1.
  void ExpectStep0AppliedOnce() {
    std::vector<float> params(layout_->padded_numel());
    auto version = client_->Gather("g", 1, DType::kFloat32, AsBytes(params)).get();
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(*version, 1);
    EXPECT_EQ(params[0], -1.0f);
  }

  std::unique_ptr<testing::TestCluster> cluster_;
  std::unique_ptr<Client> client_;
  const FlatLayout* layout_ = nullptr;
  std::unique_ptr<HandNcclWorker> worker_;
};

// A worker that opens a channel and never joins, and one that vanishes in the middle of
// a scatter: each request fails with a status within --nccl_timeout, the channel is
// closed, nothing of the scatter is kept, and the server serves on.
TEST_F(TrainingHandNcclTest, DeadNcclPeersFailTheirRequestsAndTheServerKeepsServing) {
  // 5 s: long enough for the server's join (NCCL's set-up) on a busy machine; seen
  // taking over 2 s with the integration suite running in 6 processes on one GPU.
  ASSERT_NO_FATAL_FAILURE(Start("5s"));
  EXPECT_EQ(worker_->Open("short").status().code(), absl::StatusCode::kInvalidArgument);

  // Opened, never joined: the server gives up joining after 5 s.
  auto never_joined = worker_->Open(*kernels::cuda::NcclCommunicator::NewUniqueId());
  ASSERT_TRUE(never_joined.ok()) << never_joined.status();
  {
    auto conn = cluster_->RawDataConnection(0);
    ASSERT_TRUE(conn.ok()) << conn.status();
    const absl::Status refused = worker_->Begin(**conn, transport::DataOp::kNcclGather, *never_joined);
    EXPECT_EQ(refused.code(), absl::StatusCode::kDeadlineExceeded) << refused;
    EXPECT_NE(refused.message().find("could not join"), std::string::npos) << refused;
  }

  // Joined, then silent after the ready answer of a scatter.
  auto silent = Joined();
  ASSERT_TRUE(silent.ok()) << silent.status();
  {
    auto conn = cluster_->RawDataConnection(0);
    ASSERT_TRUE(conn.ok()) << conn.status();
    ASSERT_TRUE(worker_->Begin(**conn, transport::DataOp::kNcclScatter, silent->first).ok());
    const absl::Time start = absl::Now();
    auto done = transport::RecvResponse(**conn, {});  // the worker never sends
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->status.code(), absl::StatusCode::kDeadlineExceeded) << done->status;
    EXPECT_NE(done->status.message().find("channel closed"), std::string::npos) << done->status;
    EXPECT_LT(absl::Now() - start, absl::Seconds(15));
    const absl::Status closed = worker_->Begin(**conn, transport::DataOp::kNcclGather, silent->first);
    EXPECT_EQ(closed.code(), absl::StatusCode::kNotFound) << closed;
  }
  silent->second->Abort();
  // Nothing of that scatter was kept: worker 0 sends step 0 again, over TCP, and it applies.
  const absl::Status sent = ScatterStep0(absl::ZeroDuration());
  ASSERT_TRUE(sent.ok()) << sent;
  ExpectStep0AppliedOnce();
}

// A worker that gives an NCCL scatter up after its ready answer (stopped: it closes its
// data connection and aborts its NCCL) frees its slot at once: its resend of the step over
// TCP is taken, where before the server's half waited for it until --nccl_timeout (60 s
// here) and refused the resend as "already being received" until then. And a server told
// to stop while its half of a transfer waits for a silent worker, with another channel
// whose worker never joins, exits without waiting for either (before: up to 60 s each).
TEST_F(TrainingHandNcclTest, AnNcclScatterGivenUpFreesItsSlotAndWaitsForWorkersDoNotHoldTheServersExit) {
  ASSERT_NO_FATAL_FAILURE(Start("60s"));
  auto given_up = Joined();
  ASSERT_TRUE(given_up.ok()) << given_up.status();
  {
    auto conn = cluster_->RawDataConnection(0);
    ASSERT_TRUE(conn.ok()) << conn.status();
    ASSERT_TRUE(worker_->Begin(**conn, transport::DataOp::kNcclScatter, given_up->first).ok());
  }  // closed: the worker gave the scatter up
  given_up->second->Abort();
  const absl::Time start = absl::Now();
  const absl::Status sent = ScatterStep0(absl::Seconds(30));
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the server's half waited for the worker that gave up";
  ExpectStep0AppliedOnce();

  auto silent = Joined();
  ASSERT_TRUE(silent.ok()) << silent.status();
  auto conn = cluster_->RawDataConnection(0);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(worker_->Begin(**conn, transport::DataOp::kNcclScatter, silent->first, 1).ok());  // never sends
  ASSERT_TRUE(worker_->Open(*kernels::cuda::NcclCommunicator::NewUniqueId()).ok());             // never joined
  client_.reset();
  absl::SleepFor(absl::Milliseconds(300));  // the server's half of the scatter waits
  const auto [status, took] = cluster_->Terminate(0, absl::Seconds(150));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_LT(took, absl::Seconds(20));
  silent->second->Abort();
}
#endif

TEST(TrainingIntegrationTest, UnavailableMemoryTierIsRefusedAtStartup) {
  if (HaveGpu()) GTEST_SKIP() << "this machine has the GPU tiers";
  for (const char* memory : {"--memory=device", "--memory=pinned"}) {
    EXPECT_TRUE(testing::RefusesToStart({memory})) << memory;
  }
}

TEST(TrainingIntegrationTest, NegativeThreadCountsAreRefusedAtStartup) {
  EXPECT_TRUE(testing::RefusesToStart({"--compute_threads=-1"}));
  EXPECT_TRUE(testing::RefusesToStart({"--threads=-2"}));
  EXPECT_FALSE(testing::RefusesToStart({"--compute_threads=1", "--threads=2"})) << "valid counts must start";
}

TEST(TrainingIntegrationTest, TimeoutsThatAreNotPositiveAndANegativeGraceAreRefusedAtStartup) {
  for (const char* flag :
       {"--peer_timeout=0s", "--nccl_timeout=-1s", "--staged_load_timeout=0s", "--shutdown_grace=-1s"}) {
    EXPECT_TRUE(testing::RefusesToStart({flag})) << flag;
  }
  EXPECT_FALSE(testing::RefusesToStart({"--shutdown_grace=0s", "--peer_timeout=1s"})) << "valid values must start";
}

}  // namespace
}  // namespace flatshard
