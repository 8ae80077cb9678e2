// Data-plane and optimizer benchmarks of flatshard, each printed as a ratio to an anchor
// measured in the same run on the same machine:
//   gather / scatter throughput  vs  iperf3 over loopback with the same number of streams
//   Adam step (params/s)         vs  STREAM-like triad bandwidth / 28 bytes per parameter
//   small-gather latency p50     vs  a gRPC unary call that does no work (p50), and a
//                                   bare TCP round trip of the same bytes
//   SetHyperparams (p50)         vs  the same gRPC no-op (what it took as an RPC)
//   gather / scatter over TLS    vs  the same over the plain TCP data plane (--tls_data_plane)
//   status --json of many groups vs  protobuf's JSON printer joined by an nlohmann tree
//   a step of many small groups  vs  the same transfers through the calls for one group
// Servers run in this process (the same code as flatshard-server), workers are threads
// with their own Client, all on 127.0.0.1.
//
//   build/bin/cluster_bench [--quick] [--sections=data --shapes=1x1,4x1]
#include <fcntl.h>
#include <unistd.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/cluster_status.h"
#include "core/command_line.h"
#include "core/lock_order_checks.h"
#include "flatshard/await.h"
#include "flatshard/client.h"
#include "kernels/kernels.h"
#include "proto/flatshard.grpc.pb.h"
#include "server/compute_pool.h"
#include "server/latency_histogram.h"
#include "server/server.h"
#include "server/shard_compute.h"
#include "tests/test_certificates.h"
#include "transport/tcp/tcp_transport.h"

ABSL_FLAG(bool, quick, false, "fewer configurations and shorter runs");
ABSL_FLAG(double, seconds, 1.0, "measuring time per configuration");
ABSL_FLAG(int64_t, gather_split_bytes, flatshard::ClientOptions().gather_split_bytes,
          "the workers' ClientOptions::gather_split_bytes (0: every gather one request per server)");
ABSL_FLAG(int64_t, scatter_split_bytes, flatshard::ClientOptions().scatter_split_bytes,
          "the workers' ClientOptions::scatter_split_bytes (0: every scatter one request per server)");
ABSL_FLAG(std::vector<std::string>, shapes, {},
          "data section: only these configurations, as servers x workers (e.g. 1x1,4x1; "
          "hybrid: 2x2/R2); empty: all");
ABSL_FLAG(std::vector<std::string>, one_to_one_mib, std::vector<std::string>({"4", "64", "256"}),
          "data section: the group sizes (MiB) of the 1 server x 1 worker rows");
ABSL_FLAG(std::vector<std::string>, sections,
          std::vector<std::string>({"data", "optimizer", "latency", "checkpoints", "tls"}),
          "which tables to print: data, optimizer, latency, checkpoints, tls; checkpoint-groups is the "
          "checkpoints' tables of many groups alone");

extern char** environ;

namespace flatshard::bench {
namespace {

struct Cluster {
  std::vector<std::unique_ptr<server::Server>> servers;
  std::vector<std::string> addresses;
  std::string tls_ca_file;  // with a TLS data plane: what clients trust
};

// TLS for the tls section: the test certificates (tests/test_certificates.h) in a
// directory of their own, and servers' options whose data plane speaks TLS with them.
struct BenchTls {
  std::string dir;
  server::TlsOptions options;
};

std::unique_ptr<Cluster> StartCluster(int num_servers, const std::string& checkpoint_root = "",
                                      const BenchTls* tls = nullptr) {
  auto cluster = std::make_unique<Cluster>();
  const std::vector<int> ports = *transport::PickFreeLoopbackPorts(2 * num_servers);
  for (int i = 0; i < num_servers; ++i) cluster->addresses.push_back(absl::StrCat("127.0.0.1:", ports[2 * i]));
  for (int i = 0; i < num_servers; ++i) {
    server::ServerOptions options;
    options.listen = cluster->addresses[i];
    options.data_listen = absl::StrCat("127.0.0.1:", ports[2 * i + 1]);
    options.rank = i;
    options.cluster = cluster->addresses;
    options.checkpoint_root = checkpoint_root;
    if (tls != nullptr) {
      options.tls = tls->options;
      cluster->tls_ca_file = tls->dir + "/ca.pem";
    }
    cluster->servers.push_back(std::make_unique<server::Server>(options));
    if (absl::Status started = cluster->servers.back()->Start(); !started.ok()) {
      std::cerr << "cluster_bench: " << started << "\n";
      std::exit(1);
    }
  }
  return cluster;
}

std::unique_ptr<Client> Connect(const Cluster& cluster, int rank, int workers, const std::string& job) {
  ClientOptions options;
  options.servers = cluster.addresses;
  options.worker_rank = rank;
  options.num_workers = workers;
  options.job = job;
  options.gather_split_bytes = absl::GetFlag(FLAGS_gather_split_bytes);
  options.scatter_split_bytes = absl::GetFlag(FLAGS_scatter_split_bytes);
  options.tls_ca_file = cluster.tls_ca_file;
  auto client = Client::Connect(options);
  if (!client.ok()) {
    std::cerr << "cluster_bench: " << client.status() << "\n";
    std::exit(1);
  }
  return std::move(*client);
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::cerr << "cluster_bench: " << status << "\n";
    std::exit(1);
  }
}

const FlatLayout* Register(Client& client, const std::string& group, int64_t numel) {
  auto layout = client.RegisterGroup(group, {{"w", {numel}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.0});
  Check(layout.status());
  return *layout;
}

// Aggregate bytes/s of `workers` threads each gathering a shared group of `bytes` from
// `servers` servers for `seconds`.
double GatherThroughput(int servers, int workers, int64_t bytes, double seconds, const BenchTls* tls = nullptr) {
  auto cluster = StartCluster(servers, "", tls);
  const int64_t numel = bytes / 4;
  std::atomic<int64_t> moved{0};
  std::barrier start(workers);
  std::vector<std::thread> threads;
  absl::Time begin, end;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(*cluster, w, workers, "gather");
      Check(client->ConfigureJob({}));
      const FlatLayout* layout = Register(*client, "g", numel);
      if (w == 0) Check(client->InitGroupFromSeed("g", 1));
      std::vector<float> buffer(layout->padded_numel());
      Check(client->Gather("g", 0, DType::kFloat32, AsBytes(buffer)).get().status());  // warm up
      start.arrive_and_wait();
      if (w == 0) begin = absl::Now();
      const absl::Time stop = absl::Now() + absl::Seconds(seconds);
      while (absl::Now() < stop) {
        Check(client->Gather("g", 0, DType::kFloat32, AsBytes(buffer)).get().status());
        moved += numel * 4;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  end = absl::Now();
  return static_cast<double>(moved.load()) / absl::ToDoubleSeconds(end - begin);
}

// Aggregate bytes/s of `workers` threads each scattering full gradients of `bytes` step
// after step (each worker in a job of its own, so no one waits for another; the
// server reduces and runs the optimizer as in training).
double ScatterThroughput(int servers, int workers, int64_t bytes, double seconds, const BenchTls* tls = nullptr) {
  auto cluster = StartCluster(servers, "", tls);
  const int64_t numel = bytes / 4;
  std::atomic<int64_t> moved{0};
  std::barrier start(workers);
  std::vector<std::thread> threads;
  absl::Time begin;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(*cluster, 0, 1, absl::StrCat("scatter", w));
      Check(client->ConfigureJob({}));
      const FlatLayout* layout = Register(*client, "g", numel);
      std::vector<float> grad(layout->padded_numel(), 1.0f);
      Check(client->Scatter("g", 0, DType::kFloat32, AsBytes(grad)).get());  // warm up
      start.arrive_and_wait();
      if (w == 0) begin = absl::Now();
      const absl::Time stop = absl::Now() + absl::Seconds(seconds);
      for (int64_t step = 1; absl::Now() < stop; ++step) {
        Check(client->Scatter("g", step, DType::kFloat32, AsBytes(grad)).get());
        moved += numel * 4;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return static_cast<double>(moved.load()) / absl::ToDoubleSeconds(absl::Now() - begin);
}

// Aggregate bytes/s of data-parallel training: `workers` threads in one job each scatter
// a full fp32 gradient and gather the parameters it produced, step after step. The
// servers reduce the workers' contributions and run the optimizer between the two, so
// the reduction and the step are in the loop; bytes count both directions. With
// `replicas` > 1 the job is hybrid-sharded: each worker moves its bytes with one replica
// group, and the servers' exchange of partial sums between replica groups is in the loop
// (not counted in the bytes).
double TrainingStepThroughput(int servers, int workers, int64_t bytes, double seconds, int replicas = 1) {
  auto cluster = StartCluster(servers);
  const int64_t numel = bytes / 4;
  std::atomic<int64_t> moved{0};
  std::atomic<int64_t> last_step{std::numeric_limits<int64_t>::max()};
  std::barrier start(workers);
  std::vector<std::thread> threads;
  absl::Time begin;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(*cluster, w, workers, "train");
      Check(client->ConfigureJob({.replicas = replicas}));
      const FlatLayout* layout = Register(*client, "g", numel);
      if (w == 0) Check(client->InitGroupFromSeed("g", 1));
      std::vector<float> grad(layout->padded_numel(), 1.0f), params(layout->padded_numel());
      // Workers stop after the same step: every step needs all of them. Worker 0 names
      // that step before it scatters for it, so each worker sees the name before its own
      // gather of that step can return.
      for (int64_t step = 0;; ++step) {
        if (step == 1) {  // step 0 warmed up
          start.arrive_and_wait();
          if (w == 0) begin = absl::Now();
        }
        if (w == 0 && step > 1 && absl::Now() - begin > absl::Seconds(seconds)) last_step = step;
        Check(client->Scatter("g", step, DType::kFloat32, AsBytes(grad)).get());
        Check(client->Gather("g", step + 1, DType::kFloat32, AsBytes(params)).get().status());
        if (step > 0) moved += 2 * numel * 4;
        if (step == last_step) break;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return static_cast<double>(moved.load()) / absl::ToDoubleSeconds(absl::Now() - begin);
}

// iperf3 over loopback with `streams` parallel streams, bytes/s; 0 if unavailable.
double Iperf3(int streams, double seconds) {
  const int port = (*transport::PickFreeLoopbackPorts(1))[0];
  const std::string port_text = std::to_string(port);
  std::vector<std::string> args = {"iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port_text};
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  pid_t server = 0;
  if (posix_spawnp(&server, "iperf3", &actions, nullptr, argv.data(), environ) != 0) return 0;
  posix_spawn_file_actions_destroy(&actions);
  absl::SleepFor(absl::Milliseconds(300));
  const std::string command = absl::StrFormat(
      "iperf3 -c 127.0.0.1 -p %d -P %d -t %.0f -J 2>/dev/null", port, streams, std::max(1.0, seconds));
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  char buffer[4096];
  size_t read;
  while ((read = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, read);
  pclose(pipe);
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  try {
    return nlohmann::json::parse(output)["end"]["sum_received"]["bits_per_second"].get<double>() / 8;
  } catch (const std::exception&) {
    return 0;
  }
}

// Parameters per second of the fused Adam update as a CPU-tier server runs it (on
// `threads` of a ComputePool), and the bound from a triad (a = b + s*c) measured on the
// same arrays and the same threads: 28 bytes move per parameter.
std::pair<double, double> AdamVersusBandwidth(int threads, double seconds) {
  const int64_t n = int64_t{16} << 20;
  auto pool = std::make_shared<server::ComputePool>(threads);
  std::unique_ptr<server::ShardCompute> compute = *server::MakeShardCompute(server::MemoryTier::kHost, pool);
  std::vector<float> p(n, 0.5f), g(n, 0.1f), m(n), v(n);
  auto time = [&](auto&& body) {
    body();  // warm up (page faults)
    int64_t runs = 0;
    const absl::Time begin = absl::Now();
    while (absl::Now() - begin < absl::Seconds(seconds)) {
      body();
      ++runs;
    }
    return absl::ToDoubleSeconds(absl::Now() - begin) / static_cast<double>(runs);
  };
  int64_t step = 0;
  const double adam_seconds = time([&] {
    Check(compute->AdamStep({.weight_decay = 0.01f, .decoupled_weight_decay = true}, ++step, p.data(),
                            g.data(), m.data(), v.data(), nullptr, n));
  });
  const double triad_seconds = time([&] {
    pool->ParallelFor(n, [&](int64_t begin, int64_t end) {
      float* a = m.data();
      const float* b = p.data();
      const float* c = g.data();
      for (int64_t i = begin; i < end; ++i) a[i] = b[i] + 0.5f * c[i];
      asm volatile("" : : "r"(a) : "memory");
    });
  });
  const double bandwidth = 12.0 * static_cast<double>(n) / triad_seconds;
  return {static_cast<double>(n) / adam_seconds, bandwidth / 28.0};
}

double Percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * static_cast<double>(values.size() - 1))];
}

// A round trip over loopback TCP with no flatshard in it, for the latency anchor: a
// thread answers each `request_bytes` with `response_bytes`, as a data server answers a
// small gather. Runs until destroyed.
class TcpEcho {
 public:
  TcpEcho(size_t request_bytes, size_t response_bytes) : request_(request_bytes), response_(response_bytes) {
    auto listener = transport::ListenTcp("127.0.0.1", 0);
    Check(listener.status());
    listener_ = *std::move(listener);
    server_ = std::thread([this] {
      absl::StatusOr<std::unique_ptr<transport::Connection>> conn = listener_->Accept();
      if (!conn.ok()) return;
      std::vector<std::byte> request(request_.size());
      while ((*conn)->Recv(absl::MakeSpan(request)).ok() && (*conn)->Send({absl::MakeConstSpan(response_)}).ok()) {
      }
    });
    auto client = transport::ConnectTcp("127.0.0.1", listener_->port(), absl::Seconds(10));
    Check(client.status());
    client_ = *std::move(client);
  }
  ~TcpEcho() {
    client_.reset();  // the answering thread's Recv sees the close
    server_.join();
  }
  void RoundTrip() {
    Check(client_->Send({absl::MakeConstSpan(request_)}));
    Check(client_->Recv(absl::MakeSpan(response_)));
  }

 private:
  std::vector<std::byte> request_, response_;
  std::unique_ptr<transport::Listener> listener_;
  std::unique_ptr<transport::Connection> client_;
  std::thread server_;
};

// Small-gather latency (1 KiB group, 1 server, 1 worker), waited for with future.get()
// and with flatshard::Await, against a no-op gRPC call and a bare TCP round trip of the
// same sizes (a gather request's 50 bytes, its answer's 40 + 1024), all interleaved; and
// SetHyperparams (as a learning-rate schedule makes each step; on the data connections)
// against the no-op gRPC call it would otherwise be.
void Latency(int samples) {
  auto cluster = StartCluster(1);
  auto client = Connect(*cluster, 0, 1, "latency");
  Check(client->ConfigureJob({}));
  const FlatLayout* layout = Register(*client, "small", 256);
  std::vector<float> buffer(layout->padded_numel());
  auto stub = v1::Flatshard::NewStub(grpc::CreateChannel(cluster->addresses[0], grpc::InsecureChannelCredentials()));
  TcpEcho echo(50, 40 + buffer.size() * sizeof(float));
  const std::vector<std::pair<std::string, std::function<void()>>> probes = {
      {"get", [&] { Check(client->Gather("small", 0, DType::kFloat32, AsBytes(buffer)).get().status()); }},
      {"await", [&] { Check(Await(client->Gather("small", 0, DType::kFloat32, AsBytes(buffer))).status()); }},
      {"grpc",
       [&] {
         grpc::ClientContext ctx;
         v1::ClusterInfo info;
         if (!stub->GetClusterInfo(&ctx, v1::GetClusterInfoRequest(), &info).ok()) std::exit(1);
       }},
      {"tcp", [&] { echo.RoundTrip(); }},
      {"control", [&] { Check(client->SetHyperparams({{"small", SgdOptions{.lr = 0.0}}})); }}};
  std::map<std::string, std::vector<double>> us;
  for (int i = 0; i < samples + 100; ++i) {
    for (const auto& [name, probe] : probes) {
      const absl::Time t0 = absl::Now();
      probe();
      if (i >= 100) us[name].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));  // after warm-up
    }
  }
  std::printf("\n%-40s %10s %10s %12s %8s\n", "latency", "p50 us", "p99 us", "anchor p50", "ratio");
  auto row = [&](const char* what, const std::string& probe, const std::string& anchor, const char* note) {
    const double p50 = Percentile(us[probe], 0.5), anchor_p50 = Percentile(us[anchor], 0.5);
    std::printf("%-40s %10.1f %10.1f %12.1f %7.2fx%s\n", what, p50, Percentile(us[probe], 0.99), anchor_p50,
                p50 / anchor_p50, note);
  };
  row("small gather (1 KiB), get() vs gRPC no-op", "get", "grpc", "   (target <= 2x)");
  row("small gather, Await vs gRPC no-op", "await", "grpc", "");
  row("small gather, Await vs TCP round trip", "await", "tcp", "");
  row("SetHyperparams (data plane) vs gRPC no-op", "control", "grpc", "");
}

// A step's transfers for a model of many small groups (2 servers, one worker, `groups`
// groups of 1056 fp32 parameters, a 32x32 Linear layer's): every group gathered, then
// every gradient scattered, through the calls for one group (Gather, Scatter: all
// issued, then waited for, as a prefetching worker does) against the calls for many
// (GatherGroups, ScatterGroups: pipelines of 16 per server); medians of `rounds`,
// interleaved, after one of each to warm up.
void ManySmallGroupSteps(int groups, int rounds) {
  auto cluster = StartCluster(2);
  auto client = Connect(*cluster, 0, 1, "small-groups");
  Check(client->ConfigureJob({}));
  std::vector<std::string> names;
  std::vector<GroupSpec> specs;
  for (int g = 0; g < groups; ++g) {
    names.push_back(absl::StrCat("layer", g));
    specs.push_back({names.back(), {{"w", {1056}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.0}});
  }
  absl::StatusOr<std::vector<const FlatLayout*>> layouts = client->RegisterGroups(std::move(specs));
  Check(layouts.status());
  std::vector<std::vector<float>> params(groups), grads(groups);
  std::vector<absl::Span<std::byte>> outs;
  std::vector<absl::Span<const std::byte>> sends;
  for (int g = 0; g < groups; ++g) {
    params[g].resize((*layouts)[g]->padded_numel());
    grads[g].assign(params[g].size(), 0.5f);
    outs.push_back(AsBytes(params[g]));
    sends.push_back(AsBytes(std::as_const(grads[g])));
  }
  int64_t step = 0;
  auto one_at_a_time = [&] {
    std::vector<std::future<absl::StatusOr<int64_t>>> gathered;
    for (int g = 0; g < groups; ++g) gathered.push_back(client->Gather(names[g], 0, DType::kFloat32, outs[g]));
    for (auto& future : gathered) Check(future.get().status());
    std::vector<std::future<absl::Status>> scattered;
    for (int g = 0; g < groups; ++g) scattered.push_back(client->Scatter(names[g], step, DType::kFloat32, sends[g]));
    for (auto& future : scattered) Check(future.get());
    ++step;
  };
  auto together = [&] {
    for (auto& future : client->GatherGroups(names, 0, DType::kFloat32, outs)) Check(future.get().status());
    for (auto& future : client->ScatterGroups(names, step, DType::kFloat32, sends)) Check(future.get());
    ++step;
  };
  std::vector<double> one_ms, together_ms;
  for (int round = 0; round <= rounds; ++round) {
    for (const bool many : {false, true}) {
      const absl::Time t0 = absl::Now();
      many ? together() : one_at_a_time();
      if (round > 0) (many ? together_ms : one_ms).push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    }
  }
  std::printf("\n%-40s %10s %10s %8s   (2 servers, %d groups of 1056 fp32)\n", "step of many small groups",
              "ms", "one each", "ratio", groups);
  const double ours = Percentile(together_ms, 0.5), theirs = Percentile(one_ms, 0.5);
  std::printf("%-40s %10.1f %10.1f %7.2fx\n", "GatherGroups+ScatterGroups vs per group", ours, theirs, theirs / ours);
}

// `flatshard status --json` of a cluster of many groups, from statuses already fetched
// (2 servers, `groups` groups each with its two latency histograms counted): the text
// JsonWriter writes (client/proto_json.h) against the way it was made before, protobuf's
// printer per server and an nlohmann tree to join them; medians of 3, interleaved.
void StatusJson(int groups) {
  std::vector<absl::StatusOr<v1::ServerStatus>> statuses;
  server::LatencyHistogram histogram;
  for (int i = 0; i < 40; ++i) histogram.Record(absl::Microseconds(37 * i));
  for (int rank = 0; rank < 2; ++rank) {
    v1::ServerStatus status;
    status.set_rank(rank);
    for (int g = 0; g < groups; ++g) {
      v1::GroupStatus* group = status.add_groups();
      group->set_job("default");
      group->set_group(absl::StrCat("layer", g));
      group->set_version(1000 + g);
      group->set_shard_numel(2080);
      group->set_optimizer("adamw");
      histogram.ToProto(group->mutable_reduce_seconds());
      histogram.ToProto(group->mutable_optimizer_seconds());
    }
    statuses.push_back(std::move(status));
  }
  const std::vector<std::string> servers = {"127.0.0.1:1", "127.0.0.1:2"};
  auto library = [&] {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& status : statuses) {
      std::string text;
      google::protobuf::util::JsonPrintOptions print;
      print.always_print_primitive_fields = true;
      print.preserve_proto_field_names = true;
      (void)google::protobuf::util::MessageToJsonString(*status, &text, print);
      out.push_back(nlohmann::json::parse(text));
    }
    return nlohmann::json{{"servers", out}}.dump();
  };
  size_t bytes = 0;
  std::vector<double> ours, theirs;
  for (int run = 0; run < 3; ++run) {
    absl::Time t0 = absl::Now();
    bytes = ClusterStatusJson(servers, statuses, -1).size();
    ours.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    t0 = absl::Now();
    (void)library().size();
    theirs.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  const double mb = static_cast<double>(bytes) / 1e6;
  std::printf("\n%-40s %10s %10s %8s   (2 servers x %d groups, %.1f MB of JSON)\n", "status --json", "MB/s",
              "protobuf", "ratio", groups, mb);
  const double ours_s = Percentile(ours, 0.5), theirs_s = Percentile(theirs, 0.5);
  std::printf("%-40s %10.1f %10.1f %7.2fx\n", "JsonWriter vs protobuf's printer + nlohmann", mb / ours_s,
              mb / theirs_s, theirs_s / ours_s);
}

std::string Mib(int64_t bytes) { return absl::StrFormat("%g MiB", static_cast<double>(bytes) / (1 << 20)); }

// dd's sequential write (with fdatasync) or read rate of `bytes` at `path`, bytes/s.
// The bytes and seconds a dd command reports ({0, 0} if it reports none).
std::pair<double, double> DdBytesAndSeconds(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  std::string output;
  char buffer[4096];
  size_t read;
  while ((read = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, read);
  pclose(pipe);
  // "... bytes (...) copied, 1.234 s, 1.2 GB/s"
  const size_t copied = output.find("copied, ");
  if (copied == std::string::npos) return {0, 0};
  const double bytes = std::strtod(output.c_str() + output.rfind('\n', output.find(" bytes")) + 1, nullptr);
  const double seconds = std::strtod(output.c_str() + copied + 8, nullptr);
  return {bytes, seconds};
}

double Dd(const std::string& command) {
  const auto [bytes, seconds] = DdBytesAndSeconds(command);
  return seconds > 0 ? bytes / seconds : 0;
}

// dd's read rate over every file of `dir`, one after the other (with iflag=direct: from
// the disk).
double DdFiles(const std::string& dir, bool direct) {
  double bytes = 0, seconds = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const auto [file_bytes, file_seconds] = DdBytesAndSeconds(absl::StrFormat(
        "dd if=%s of=/dev/null bs=4M%s", entry.path().string(), direct ? " iflag=direct" : ""));
    bytes += file_bytes;
    seconds += file_seconds;
  }
  return seconds > 0 ? bytes / seconds : 0;
}

// Drops the page cache of every file below `dir` (they are clean after a save's fsync),
// so that the next read comes from the disk.
void DropCache(const std::string& dir) {
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const int fd = open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"); 0 if absent.
int64_t ProcStatusKib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::strtoll(line.c_str() + field.size() + 1, nullptr, 10);
  }
  return 0;
}

// Resets the peak RSS (VmHWM) to the current RSS; returns the current RSS in KiB.
int64_t ResetPeakRssKib() {
  std::ofstream("/proc/self/clear_refs") << "5";
  return ProcStatusKib("VmRSS");
}

// Reads every file below `dir` through the page cache (saves write around it).
void FillCache(const std::string& dir) {
  std::vector<char> buffer(4 << 20);
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const int fd = open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    while (read(fd, buffer.data(), buffer.size()) > 0) {
    }
    close(fd);
  }
}

double TimeIt(const std::function<absl::Status()>& body) {
  const absl::Time start = absl::Now();
  Check(body());
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// Save, load, export and import throughput of a model on 2 servers, vs dd on the same disk.
// This disk's rates swing by several times within seconds, so every row interleaves 3
// runs of its anchor with 3 runs of the operation and compares the medians: writes vs dd
// conv=fdatasync into a new file (as a save writes new files), cold loads (page cache
// dropped) vs dd iflag=direct, warm loads (the files read into the page cache first:
// saves write around it) vs a plain dd from the page cache; the read anchors read the
// very files the load reads, cold ones in alternating order (the host below this VM
// caches what the guest dropped, so whichever reads second gains). On this VM, touching memory
// that was freed more than ~2 s earlier is ~10x slower than reusing memory just freed
// (the host takes free pages back; a 20-line test: a 256 MiB pread into fresh memory runs
// at 0.3 GB/s after a 3 s pause, 5.3 GB/s right after the previous one). A load's fresh
// staging buffers meet it whenever the memory it gets was freed long ago, which dd's
// reused 4 MiB buffer never does; the first load of a row may show it.
void Checkpoints(int64_t bytes) {
  char scratch[] = "/tmp/flatshard-bench-XXXXXX";
  const std::string dir = mkdtemp(scratch);
  const std::string root = dir + "/root";
  std::filesystem::create_directories(root);
  const int64_t dd_blocks = bytes >> 22;
  int dd_files = 0;
  auto dd_write = [&] {
    return Dd(absl::StrFormat("dd if=/dev/zero of=%s/dd-%d bs=4M count=%d conv=fdatasync", dir, ++dd_files, dd_blocks));
  };

  auto cluster = StartCluster(2, root);
  auto client = Connect(*cluster, 0, 1, "ckpt");
  Check(client->ConfigureJob({}));
  Check(client->RegisterGroup("g", {{"w", {bytes / 4}, DType::kFloat32}}, 0, SgdOptions{.lr = 0.1}).status());
  Check(client->InitGroupFromSeed("g", 1));
  std::printf("\n%-40s %10s %10s %8s   (model %s on 2 servers; medians of 3, interleaved)\n", "checkpoint", "GB/s",
              "dd GB/s", "ratio", Mib(bytes).c_str());
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // Run i: anchor(i), then body(i), timed; with `alternate`, odd runs body first.
  auto row = [&](const std::string& name, const std::function<double(int)>& anchor,
                 const std::function<absl::Status(int)>& body, bool alternate = false) {
    std::vector<double> anchors, rates;
    for (int i = 0; i < 3; ++i) {
      const bool body_first = alternate && i % 2 == 1;
      if (!body_first) anchors.push_back(anchor(i));
      rates.push_back(static_cast<double>(bytes) / TimeIt([&] { return body(i); }));
      if (body_first) anchors.push_back(anchor(i));
    }
    const double rate = median(rates), base = median(anchors);
    std::printf("%-40s %10.2f %10.2f %7.2fx\n", name.c_str(), rate / 1e9, base / 1e9, rate / base);
    std::fflush(stdout);
  };
  for (auto [name, kind] : {std::pair{"full", CheckpointKind::kFull}, std::pair{"sharded", CheckpointKind::kSharded},
                            std::pair{"local", CheckpointKind::kLocal}}) {
    const std::string checkpoint = name;
    row(absl::StrCat("save ", name, " vs dd conv=fdatasync"), [&](int) { return dd_write(); },
        [&](int i) { return client->SaveCheckpoint(absl::StrCat(checkpoint, "-", i), kind, false); });
    // One checkpoint, read into the page cache once: filling the cache with another
    // 512 MiB between runs would take the memory the last load freed, and hand the next
    // load's staging buffers pages the host had taken back (see above).
    const std::string warm = absl::StrCat(root, "/", checkpoint, "-0");
    row(absl::StrCat("load ", name, " (warm) vs dd"),
        [&](int) {
          FillCache(warm);
          return DdFiles(warm, /*direct=*/false);
        },
        [&](int) { return client->LoadCheckpoint(absl::StrCat(checkpoint, "-0")); });
    // Each cold run reads another checkpoint, dropped from the page cache before each read.
    row(absl::StrCat("load ", name, " (cold) vs dd iflag=direct"),
        [&](int i) { return DdFiles(absl::StrCat(root, "/", checkpoint, "-", i), /*direct=*/true); },
        [&](int i) {
          DropCache(absl::StrCat(root, "/", checkpoint, "-", i));
          return client->LoadCheckpoint(absl::StrCat(checkpoint, "-", i));
        },
        /*alternate=*/true);
  }
  for (auto [name, kind] : {std::pair{"full", CheckpointKind::kFull}, std::pair{"sharded", CheckpointKind::kSharded}}) {
    const std::string exported = absl::StrCat(dir, "/export-", name, "-");
    row(absl::StrCat("export ", name, " vs dd conv=fdatasync"), [&](int) { return dd_write(); },
        [&](int i) { return client->ExportStateDict(absl::StrCat(exported, i), kind, false); });
    // The reverse: each export streamed back to server 0 (one gRPC stream of 4 MiB
    // chunks, written through O_DIRECT and fsync'd, as a save writes) and committed as a
    // checkpoint (SHARDED: its pieces checked and indexed first).
    row(absl::StrCat("import ", name, " vs dd conv=fdatasync"), [&](int) { return dd_write(); },
        [&](int i) {
          return client->ImportCheckpoint(absl::StrCat("imported-", name, "-", i), absl::StrCat(exported, i)).status();
        });
  }
  // The exporter's memory: peak RSS growth over one more export (this process holds the
  // client and both servers, so it bounds the client's from above).
  const int64_t before = ResetPeakRssKib();
  Check(client->ExportStateDict(dir + "/export-rss", CheckpointKind::kFull, false));
  const double growth_mib = static_cast<double>(ProcStatusKib("VmHWM") - before) / 1024;
  std::printf("%-40s %10.1f MiB per GiB of model (%.1f MiB for %s; client + servers)\n", "export full: peak RSS growth",
              growth_mib * static_cast<double>(int64_t{1} << 30) / static_cast<double>(bytes), growth_mib,
              Mib(bytes).c_str());
  std::filesystem::remove_all(dir);
}

// What a checkpoint costs per tensor: a model wrapped module by module, `groups` groups of
// a `side`x`side` weight and a `side`-element bias (AdamW), against one group of the same
// bytes, on 2 servers, saved and loaded (files in the page cache) alternately, 3 runs
// each; the ratio is many groups' rate over one group's (1.0x: no cost per tensor). Tiny
// groups (64x64: 16 KiB) are the worst case, each server writing a short run of every
// array of every group; groups of 1 MiB are a model wrapped as FSDP users wrap one.
// Before the fortieth session's changes, 20000 groups of 64x64 took 24 s to save FULL and
// 17 s to load it (quadratic header handling, a completion-queue poll and a disk wait
// per piece).
void ManyGroupCheckpoints(int groups, int64_t side) {
  char scratch[] = "/tmp/flatshard-bench-XXXXXX";
  const std::string dir = mkdtemp(scratch);
  const std::string root = dir + "/root";
  std::filesystem::create_directories(root);
  auto cluster = StartCluster(2, root);
  auto many = Connect(*cluster, 0, 1, "many");
  auto one = Connect(*cluster, 0, 1, "one");
  Check(many->ConfigureJob({}));
  Check(one->ConfigureJob({}));
  const int64_t kWeight = side * side, kBias = side;
  for (int g = 0; g < groups; ++g) {
    const std::string name = absl::StrCat("layer", g);
    const std::vector<TensorSpec> tensors = {{name + ".weight", {side, side}, DType::kFloat32},
                                             {name + ".bias", {kBias}, DType::kFloat32}};
    Check(many->RegisterGroup(name, tensors, 0, AdamOptions{}).status());
    Check(many->InitGroupFromSeed(name, g));
  }
  const int64_t numel = groups * (kWeight + kBias);
  Check(one->RegisterGroup("all", {{"all.weight", {numel}, DType::kFloat32}}, 0, AdamOptions{}).status());
  Check(one->InitGroupFromSeed("all", 1));
  const double bytes = static_cast<double>(numel) * 4 * 3;  // parameters and AdamW's two states
  std::printf("\n%-40s %10s %10s %8s   (%d groups of a %lldx%lld weight and a bias vs 1 group, %s with optimizer "
              "state, 2 servers)\n",
              side <= 64 ? "checkpoint of many small groups" : "checkpoint of many groups", "GB/s", "1 group", "ratio",
              groups, static_cast<long long>(side), static_cast<long long>(side),
              Mib(static_cast<int64_t>(bytes)).c_str());
  for (auto [name, kind] : {std::pair{"full", CheckpointKind::kFull}, std::pair{"sharded", CheckpointKind::kSharded}}) {
    std::vector<double> save_many, save_one, load_many, load_one;
    for (int i = 0; i < 3; ++i) {
      for (Client* client : {many.get(), one.get()}) {
        const std::string checkpoint = absl::StrCat(client == many.get() ? "many-" : "one-", name, "-", i);
        const double saved = TimeIt([&] { return client->SaveCheckpoint(checkpoint, kind, true); });
        const double loaded = TimeIt([&] { return client->LoadCheckpoint(checkpoint); });
        (client == many.get() ? save_many : save_one).push_back(bytes / saved);
        (client == many.get() ? load_many : load_one).push_back(bytes / loaded);
        Check(client->DeleteCheckpoint(checkpoint));
      }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    for (auto [what, rates, anchors] :
         {std::tuple{"save", &save_many, &save_one}, std::tuple{"load", &load_many, &load_one}}) {
      const double rate = median(*rates), base = median(*anchors);
      std::printf("%-40s %10.2f %10.2f %7.2fx\n", absl::StrCat(what, " ", name, " (optimizer too)").c_str(), rate / 1e9,
                  base / 1e9, rate / base);
    }
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
}

// Gather and scatter throughput per (servers, workers, group size), vs iperf3 over
// loopback with as many streams; `shapes` (servers x workers, "/R<replicas>" for hybrid
// rows) limits the configurations when not empty.
void DataPlane(bool quick, double seconds, const std::vector<std::string>& shapes,
               const std::vector<int64_t>& one_to_one_bytes) {
  struct Config {
    int servers, workers;
    int64_t bytes;
    int replicas = 1;  // > 1: a hybrid-sharded training step only
  };
  std::vector<Config> configs;
  if (quick) {
    configs = {{1, 1, 64 << 20}, {2, 2, 64 << 20}, {2, 2, 64 << 20, 2}};
  } else {
    for (int64_t bytes : one_to_one_bytes) configs.push_back({1, 1, bytes});
    for (int servers : {1, 2, 4}) {
      for (int workers : {1, 2, 4}) {
        if (!(servers == 1 && workers == 1)) configs.push_back({servers, workers, int64_t{64} << 20});
      }
    }
    configs.push_back({2, 2, int64_t{64} << 20, 2});
    configs.push_back({4, 4, int64_t{64} << 20, 2});
    configs.push_back({3, 3, int64_t{64} << 20});
    configs.push_back({3, 3, int64_t{64} << 20, 3});
  }
  if (!shapes.empty()) {
    std::erase_if(configs, [&](const Config& c) {
      const std::string shape =
          absl::StrCat(c.servers, "x", c.workers, c.replicas > 1 ? absl::StrCat("/R", c.replicas) : "");
      return std::find(shapes.begin(), shapes.end(), shape) == shapes.end();
    });
  }
  std::printf("%-8s %7s %7s %8s %10s %14s %8s\n", "op", "servers", "workers", "group", "GB/s",
              "iperf3 GB/s", "ratio");
  std::map<int, double> iperf;  // by stream count
  for (const Config& c : configs) {
    const int streams = c.servers * c.workers;
    if (!iperf.count(streams)) iperf[streams] = Iperf3(streams, seconds < 1 ? 1 : 2);
    const double anchor = iperf[streams];
    for (const std::string op : {"gather", "scatter", "step"}) {
      if (op == "step" && c.workers == 1) continue;  // the scatter row is that job
      if (op != "step" && c.replicas > 1) continue;
      const double rate = op == "gather"    ? GatherThroughput(c.servers, c.workers, c.bytes, seconds)
                          : op == "scatter" ? ScatterThroughput(c.servers, c.workers, c.bytes, seconds)
                                            : TrainingStepThroughput(c.servers, c.workers, c.bytes, seconds, c.replicas);
      const std::string label = c.replicas > 1 ? absl::StrCat("step/R", c.replicas) : op;
      if (anchor > 0) {
        std::printf("%-8s %7d %7d %8s %10.2f %14.2f %7.2fx\n", label.c_str(), c.servers, c.workers,
                    Mib(c.bytes).c_str(), rate / 1e9, anchor / 1e9, rate / anchor);
      } else {
        std::printf("%-8s %7d %7d %8s %10.2f %14s %8s\n", label.c_str(), c.servers, c.workers,
                    Mib(c.bytes).c_str(), rate / 1e9, "n/a", "n/a");
      }
      std::fflush(stdout);
    }
  }
}

// Gather and scatter throughput with the data plane in TLS (--tls_data_plane: AES-GCM in
// OpenSSL, one TLS connection per transfer in flight) against the plain TCP data plane,
// alternated twice per row; returns false if the certificates could not be made.
bool TlsDataPlane(double seconds) {
  BenchTls tls;
  tls.dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/cluster-bench-tls-", getpid());
  std::filesystem::create_directories(tls.dir);
  const bool made = testing::MakeTestCertificates(tls.dir);
  auto read = [&](const char* name) {
    std::ifstream in(tls.dir + "/" + name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  tls.options = {.cert_chain = read("server.pem"), .private_key = read("server.key"), .root_certs = read("ca.pem")};
  tls.options.data_plane = true;
  if (!made) {
    std::filesystem::remove_all(tls.dir);
    return false;
  }
  std::printf("\n%-8s %7s %7s %8s %10s %14s %8s\n", "op", "servers", "workers", "group", "TLS GB/s", "plain GB/s",
              "ratio");
  for (const auto& [servers, workers] : {std::pair{1, 1}, std::pair{2, 2}}) {
    const int64_t bytes = int64_t{64} << 20;
    for (const std::string op : {"gather", "scatter"}) {
      auto run = [&](const BenchTls* with) {
        return op == "gather" ? GatherThroughput(servers, workers, bytes, seconds, with)
                              : ScatterThroughput(servers, workers, bytes, seconds, with);
      };
      double secure = 0, plain = 0;
      for (int round = 0; round < 2; ++round) {
        plain += run(nullptr);
        secure += run(&tls);
      }
      std::printf("%-8s %7d %7d %8s %10.2f %14.2f %7.2fx\n", op.c_str(), servers, workers, Mib(bytes).c_str(),
                  secure / 2e9, plain / 2e9, secure / plain);
      std::fflush(stdout);
    }
  }
  std::filesystem::remove_all(tls.dir);
  return true;
}

}  // namespace
}  // namespace flatshard::bench

int main(int argc, char** argv) {
  using namespace flatshard::bench;
  absl::SetProgramUsageMessage(
      "cluster_bench [--quick] [--sections=data,optimizer,latency,checkpoints] [--shapes=1x1,2x2/R2]: ratios "
      "against anchors measured in the same run");
  flatshard::ParseCommandLineOrExit(argc, argv, "cluster_bench");
  // As flatshard-server runs (--mutex_deadlock_detection off); FLATSHARD_BENCH_DEADLOCK_DETECTION=1
  // measures with Abseil's lock-order checks, the default of a build without NDEBUG (Debian's).
  flatshard::SetLockOrderChecksFromEnvironment("FLATSHARD_BENCH_DEADLOCK_DETECTION");
  const bool quick = absl::GetFlag(FLAGS_quick);
  const double seconds = quick ? 0.4 : absl::GetFlag(FLAGS_seconds);

  const std::vector<std::string> sections = absl::GetFlag(FLAGS_sections);
  auto wanted = [&](const char* section) { return std::find(sections.begin(), sections.end(), section) != sections.end(); };
  if (wanted("data")) {
    std::vector<int64_t> one_to_one_bytes;
    for (const std::string& mib : absl::GetFlag(FLAGS_one_to_one_mib)) {
      double value = 0;
      if (!absl::SimpleAtod(mib, &value) || value <= 0) {
        std::fprintf(stderr, "cluster_bench: --one_to_one_mib takes positive sizes in MiB, not '%s'\n", mib.c_str());
        return 2;
      }
      one_to_one_bytes.push_back(static_cast<int64_t>(value * (1 << 20)) / 4 * 4);
    }
    DataPlane(quick, seconds, absl::GetFlag(FLAGS_shapes), one_to_one_bytes);
  }
  if (wanted("optimizer")) {
    std::vector<int> thread_counts = {1};
    if (const int all = flatshard::server::ComputePool(0).threads(); all > 1) thread_counts.push_back(all);
    std::printf("\n%-34s %10s %12s %8s\n", "optimizer (16M params)", "Mparam/s", "bound", "ratio");
    for (const int threads : thread_counts) {
      const auto [adam, bound] = AdamVersusBandwidth(threads, seconds);
      const std::string label = absl::StrCat("AdamW, ", threads, " thread", threads == 1 ? "" : "s",
                                             " vs triad / 28 B");
      std::printf("%-34s %10.0f %12.0f %7.2fx   (target >= 0.7x)\n", label.c_str(), adam / 1e6,
                  bound / 1e6, adam / bound);
    }
  }
  if (wanted("latency")) {
    Latency(quick ? 300 : 2000);
    ManySmallGroupSteps(quick ? 200 : 1000, quick ? 3 : 7);
    StatusJson(quick ? 2000 : 20000);
  }
  if (wanted("checkpoints")) {
    Checkpoints(quick ? (int64_t{64} << 20) : (int64_t{512} << 20));
  }
  if (wanted("checkpoints") || wanted("checkpoint-groups")) {
    ManyGroupCheckpoints(quick ? 1000 : 10000, 64);
    ManyGroupCheckpoints(quick ? 16 : 128, 512);
  }
  if (wanted("tls") && !TlsDataPlane(seconds)) {
    std::fprintf(stderr, "cluster_bench: openssl could not make the certificates of the tls section\n");
    return 1;
  }
  return 0;
}
