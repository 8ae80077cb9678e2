// `flatshard status` (client/cli/status_command.h) against real servers: the table and
// the JSON describe every server (memory, plane, TLS, kernel threads, groups, calls
// refused for their credentials), the jobs' table sums up each job's groups (which many
// groups leave to it alone), and a server that does not answer makes it fail while the
// others are still listed.
#include "client/cli/status_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cli/human_bytes.h"
#include "client/cli/layout_command.h"
#include "client/cluster_status.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The whitespace-separated words of the first line of `text` whose first two words
// are `first` and `second`; empty when there is none.
std::vector<std::string> Row(const std::string& text, const std::string& first, const std::string& second) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (words.size() >= 2 && words[0] == first && words[1] == second) return words;
  }
  return {};
}

// Each job's summary in `summed_up` (statuses asked with GetStatusRequest.summarize_groups
// and omit_groups) is what its groups in `listed` (the same servers' statuses with their
// groups, nothing changed between) sum up to.
void ExpectSummariesOfTheirGroups(const std::vector<absl::StatusOr<v1::ServerStatus>>& listed,
                                  const std::vector<absl::StatusOr<v1::ServerStatus>>& summed_up) {
  ASSERT_EQ(listed.size(), summed_up.size());
  for (size_t rank = 0; rank < listed.size(); ++rank) {
    ASSERT_TRUE(listed[rank].ok()) << listed[rank].status();
    ASSERT_TRUE(summed_up[rank].ok()) << summed_up[rank].status();
    EXPECT_EQ(summed_up[rank]->groups_size(), 0);
    ASSERT_EQ(summed_up[rank]->jobs_size(), listed[rank]->jobs_size());
    for (const v1::JobStatus& job : summed_up[rank]->jobs()) {
      int groups = 0;
      int64_t bytes = 0, min_version = 0, max_version = 0;
      uint64_t reduced = 0, stepped = 0;
      double optimizer_seconds = 0;
      for (const v1::GroupStatus& g : listed[rank]->groups()) {
        if (g.job() != job.job()) continue;
        min_version = groups == 0 ? g.version() : std::min(min_version, g.version());
        max_version = groups == 0 ? g.version() : std::max(max_version, g.version());
        ++groups;
        bytes += g.bytes();
        reduced += g.reduce_seconds().count();
        stepped += g.optimizer_seconds().count();
        optimizer_seconds += g.optimizer_seconds().sum_seconds();
      }
      const v1::JobGroupsSummary& summary = job.summary();
      EXPECT_EQ(summary.groups(), groups) << job.job();
      EXPECT_EQ(summary.bytes(), bytes) << job.job();
      EXPECT_EQ(summary.min_version(), min_version) << job.job();
      EXPECT_EQ(summary.max_version(), max_version) << job.job();
      EXPECT_EQ(summary.reduce_seconds().count(), reduced) << job.job();
      EXPECT_EQ(summary.optimizer_seconds().count(), stepped) << job.job();
      EXPECT_DOUBLE_EQ(summary.optimizer_seconds().sum_seconds(), optimizer_seconds) << job.job();
    }
  }
}

TEST(StatusCommandTest, TableAndJsonDescribeEveryServerAndAnUnreachableOneFails) {
  testing::TestCluster cluster(2, "status-token", ::testing::TempDir(), "",
                               {{"--compute_threads=3", "--memory=host"}, {"--compute_threads=3", "--memory=host"}});
  auto client = cluster.Connect(0, 1, "status");
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->ConfigureJob({}).ok());
  ASSERT_TRUE((*client)->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{}).ok());
  // A hybrid-sharded job: both servers hold shard 0, in replica groups 0 and 1.
  auto hybrid = cluster.Connect(0, 2, "hybrid");
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  ASSERT_TRUE((*hybrid)->ConfigureJob({.replicas = 2}).ok());
  ASSERT_TRUE((*hybrid)->RegisterGroup("h", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{}).ok());
  // One step of it: each server sends its peer the chunk the peer reduces, then the
  // chunk it reduced itself, 1000 float32 in all, and takes as much.
  auto second = cluster.Connect(1, 2, "hybrid");
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*second)->RegisterGroup("h", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{}).ok());
  const std::vector<float> grad(1000, 1.0f);
  const auto grad_bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(grad.data()), 4000);
  auto scattered = (*hybrid)->Scatter("h", 0, DType::kFloat32, grad_bytes);
  ASSERT_TRUE((*second)->Scatter("h", 0, DType::kFloat32, grad_bytes).get().ok());
  ASSERT_TRUE(scattered.get().ok());
  for (auto* worker : {&*hybrid, &*second}) ASSERT_TRUE((*worker)->WaitVersion("h", 1).ok());

  // A caller with a wrong token, twice, at server 1.
  const auto wrong = FetchClusterStatus({.servers = {cluster.addresses()[1]}, .token = "not-the-token"});
  ASSERT_EQ(wrong[0].status().code(), absl::StatusCode::kUnauthenticated);
  ASSERT_FALSE(FetchClusterStatus({.servers = {cluster.addresses()[1]}, .token = "not-the-token"})[0].ok());

  cli::StatusCommandOptions options{.servers = cluster.addresses(), .token = cluster.token()};
  std::ostringstream table, err;
  ASSERT_EQ(cli::RunStatusCommand(options, table, err), 0) << err.str();
  EXPECT_THAT(table.str(), HasSubstr("\nserver 1: 2 calls refused for their credentials since it started (GetStatus "
                                     "2): a client or peer with a wrong token or certificate?"))
      << table.str();
  EXPECT_THAT(table.str(), Not(HasSubstr("server 0: "))) << table.str();
  const auto statuses = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()});
  for (const auto& status : statuses) ASSERT_TRUE(status.ok()) << status.status();
  // Each server sums up each job's groups when asked (GetStatusRequest.summarize_groups),
  // with or without them; a job's load digest is the same on both servers (nothing was
  // loaded) and depends on its groups' names.
  v1::GetStatusRequest summarize;
  summarize.set_summarize_groups(true);
  summarize.set_omit_groups(true);
  const auto summed_up = FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()}, {}, summarize);
  ExpectSummariesOfTheirGroups(statuses, summed_up);
  std::map<std::string, std::set<uint64_t>> digests;  // job -> the servers' load digests
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(summed_up[rank]->jobs_size(), 2);
    for (const v1::JobStatus& job : summed_up[rank]->jobs()) digests[job.job()].insert(job.summary().load_digest());
  }
  EXPECT_EQ(summed_up[0]->jobs(0).summary().max_version() + summed_up[0]->jobs(1).summary().max_version(), 1)
      << "the hybrid job stepped once, the other never";
  ASSERT_EQ(digests.size(), 2u);
  for (const auto& [job, seen] : digests) EXPECT_EQ(seen.size(), 1u) << job;
  EXPECT_NE(*digests["status"].begin(), *digests["hybrid"].begin());
  // job, workers, mode, replicas, max_norm, skip_inf, last_norm, skipped, groups,
  // versions, memory (2 words: the job's groups on both servers)
  std::map<std::string, int64_t> job_bytes;
  for (const auto& status : statuses) {
    for (const v1::GroupStatus& g : status->groups()) job_bytes[g.job()] += g.bytes();
  }
  auto with_memory = [&](std::vector<std::string> row) {
    const std::vector<std::string> memory = absl::StrSplit(cli::HumanBytes(job_bytes[row[0]]), ' ');
    row.insert(row.end(), memory.begin(), memory.end());
    return row;
  };
  EXPECT_EQ(Row(table.str(), "status", "1"), with_memory({"status", "1", "sync", "1", "0", "no", "-", "0", "1", "0"}))
      << table.str();
  EXPECT_EQ(Row(table.str(), "hybrid", "2"),
            with_memory({"hybrid", "2", "sync", "2", "0", "no", "-", "0", "1", "1"}))  // stepped once
      << table.str();
  for (int rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    // rank, address, memory, plane, tls, threads, groups, ...
    const std::vector<std::string> server = Row(table.str(), r, cluster.addresses()[rank]);
    ASSERT_GE(server.size(), 7u) << table.str();
    EXPECT_EQ(std::vector<std::string>(server.begin() + 2, server.begin() + 7),
              (std::vector<std::string>{"host", "tcp", "no", "3", "2"}))
        << table.str();
    // ..., held (2 words), conns, busy, sent (2), received (2), x-sent (2), x-recv (2), ...
    ASSERT_GE(server.size(), 19u) << table.str();
    int64_t held = 0;
    for (const v1::GroupStatus& g : statuses[rank]->groups()) held += g.bytes();
    EXPECT_EQ(absl::StrCat(server[7], " ", server[8]), cli::HumanBytes(held)) << table.str();
    EXPECT_EQ(server[10], "0") << table.str();  // nothing but the command's own GetStatus
    EXPECT_EQ(std::vector<std::string>(server.begin() + 15, server.begin() + 19),
              (std::vector<std::string>{"3.9", "KiB", "3.9", "KiB"}))
        << table.str();
    // rank, job/group, version, shard_numel (500 of 1000 elements), memory (2 words),
    // optimizer, pending, shard, replica, load
    const std::vector<std::string> group = Row(table.str(), r, "status/g");
    ASSERT_EQ(group.size(), 11u) << table.str();
    EXPECT_EQ(group[2], "0");
    EXPECT_EQ(group[3], "500");
    EXPECT_EQ(group[8], r);
    EXPECT_EQ(group[9], "0");
    EXPECT_EQ(group[10], "-");  // never loaded
    const std::vector<std::string> replicated = Row(table.str(), r, "hybrid/h");
    ASSERT_EQ(replicated.size(), 11u) << table.str();
    EXPECT_EQ(replicated[3], "1000");
    EXPECT_EQ(replicated[8], "0");
    EXPECT_EQ(replicated[9], r);
    // Server-side times: rank, what, count, p50 (2 words), p99 (2), mean (2). Each server
    // took one scatter and one step of the hybrid job; the other group never stepped.
    const std::vector<std::string> scatter = Row(table.str(), r, "scatter");
    ASSERT_EQ(scatter.size(), 9u) << table.str();
    EXPECT_EQ(scatter[2], "1") << table.str();
    for (const char* what : {"reduce", "optimizer"}) {
      const std::vector<std::string> step = Row(table.str(), r, what);
      ASSERT_EQ(step.size(), 10u) << table.str();
      EXPECT_EQ(step[2], "hybrid/h") << table.str();
      EXPECT_EQ(step[3], "1") << table.str();
    }
    EXPECT_EQ(table.str().find("reduce status/g"), std::string::npos) << table.str();
  }

  // Past max_group_rows (4 rows here: a group of each job on each server) the groups are
  // summed up by the jobs' table, and their times by a row per job; --groups lists them.
  options.max_group_rows = 3;
  std::ostringstream summed;
  ASSERT_EQ(cli::RunStatusCommand(options, summed, err), 0) << err.str();
  EXPECT_THAT(summed.str(), HasSubstr("\n4 rows of groups (one per group per server) not listed: the jobs' table "
                                      "sums them up; --groups lists them"))
      << summed.str();
  EXPECT_THAT(summed.str(), Not(HasSubstr("job/group"))) << summed.str();
  EXPECT_EQ(Row(summed.str(), "hybrid", "2"), Row(table.str(), "hybrid", "2")) << summed.str();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(Row(summed.str(), std::to_string(rank), "reduce").at(2), "hybrid/*") << summed.str();
    EXPECT_EQ(Row(summed.str(), std::to_string(rank), "optimizer").at(3), "1") << summed.str();
  }
  options.all_groups = true;
  std::ostringstream listed;
  ASSERT_EQ(cli::RunStatusCommand(options, listed, err), 0) << err.str();
  for (const std::string rank : {"0", "1"}) {
    for (const std::string what : {"status/g", "hybrid/h"}) {
      EXPECT_EQ(Row(listed.str(), rank, what), Row(table.str(), rank, what)) << listed.str();
    }
    EXPECT_EQ(Row(listed.str(), rank, "reduce").at(2), "hybrid/h") << listed.str();
  }
  options.all_groups = false;
  options.max_group_rows = cli::StatusCommandOptions().max_group_rows;

  options.json = true;
  std::ostringstream json;
  ASSERT_EQ(cli::RunStatusCommand(options, json, err), 0) << err.str();
  const nlohmann::json parsed = nlohmann::json::parse(json.str());
  ASSERT_EQ(parsed["servers"].size(), 2u);
  for (const auto& server : parsed["servers"]) {
    EXPECT_EQ(server["compute_threads"], 3);
    EXPECT_EQ(server["tls"], false);
    EXPECT_EQ(server["memory"], "host");
    EXPECT_EQ(server["groups"].size(), 2u);
    EXPECT_EQ(server["exchange_bytes_sent"], "4000");  // proto3 JSON: int64 as a string
    EXPECT_EQ(server["exchange_bytes_received"], "4000");
    EXPECT_FALSE(server["data_request_seconds"].empty());
    EXPECT_FALSE(server["rpc_seconds"].empty());
  }

  const std::vector<int> free_port = *transport::PickFreeLoopbackPorts(1);
  options = {.servers = {cluster.addresses()[0], absl::StrCat("127.0.0.1:", free_port[0])},
             .token = cluster.token(), .timeout = absl::Seconds(2)};
  std::ostringstream partial, partial_err;
  EXPECT_EQ(cli::RunStatusCommand(options, partial, partial_err), 1);
  EXPECT_EQ(Row(partial.str(), "0", cluster.addresses()[0]).at(2), "host") << partial.str();
  EXPECT_NE(partial.str().find("unreachable"), std::string::npos) << partial.str();
  // Nothing listens on the free port: the hint says so, not that TLS settings differ.
  EXPECT_NE(partial.str().find("nothing listens at that address"), std::string::npos) << partial.str();
  EXPECT_EQ(partial.str().find("tls_ca_file"), std::string::npos) << partial.str();
  EXPECT_NE(partial_err.str().find("some servers did not answer"), std::string::npos);

  // None answers: the servers' rows say why, and no empty tables follow.
  options.servers = {absl::StrCat("127.0.0.1:", free_port[0])};
  std::ostringstream none, none_err;
  EXPECT_EQ(cli::RunStatusCommand(options, none, none_err), 1);
  EXPECT_NE(none.str().find("unreachable"), std::string::npos) << none.str();
  EXPECT_EQ(none.str().find("job/group"), std::string::npos) << none.str();
  EXPECT_NE(none_err.str().find("no server answered"), std::string::npos) << none_err.str();
}

// What `flatshard layout` plans for a group is what the servers report holding for it
// once `workers` workers have trained it on `servers` servers in `replicas` replica
// groups: parameters, gradient, Adam's moments, a staging slot per worker of the replica
// group in the gradients' dtype, the gather snapshot (a second one while a slow reader
// holds the previous version's) and a hybrid job's exchange buffers.
void ExpectHeldAsPlanned(int servers, int replicas, int workers) {
  testing::TestCluster cluster(servers, "status-token", ::testing::TempDir());
  std::vector<std::unique_ptr<Client>> clients;
  for (int rank = 0; rank < workers; ++rank) {
    auto client = cluster.Connect(rank, workers, "planned");
    ASSERT_TRUE(client.ok()) << client.status();
    clients.push_back(*std::move(client));
  }
  ASSERT_TRUE(clients[0]->ConfigureJob({.replicas = replicas}).ok());
  const FlatLayout* layout = nullptr;
  for (auto& worker : clients) {
    auto registered =
        worker->RegisterGroup("g", {{"w", {300, 7}, DType::kFloat32}, {"b", {7}, DType::kFloat32}}, 4, AdamOptions{});
    ASSERT_TRUE(registered.ok()) << registered.status();
    layout = *registered;
  }
  ASSERT_EQ(layout->num_shards(), servers / replicas);
  ASSERT_TRUE(clients[0]->InitGroupFromSeed("g", 3).ok());
  std::vector<uint16_t> params(layout->padded_numel()), grad(layout->padded_numel(), 0x3f80);  // bf16 1.0
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<std::future<absl::Status>> scattered;
    for (auto& worker : clients) {
      ASSERT_TRUE(worker
                      ->Gather("g", step, DType::kBFloat16,
                               absl::MakeSpan(reinterpret_cast<std::byte*>(params.data()), params.size() * 2))
                      .get()
                      .ok());
      scattered.push_back(
          worker->Scatter("g", step, DType::kBFloat16,
                          absl::MakeConstSpan(reinterpret_cast<const std::byte*>(grad.data()), grad.size() * 2)));
    }
    for (auto& s : scattered) ASSERT_TRUE(s.get().ok());
  }

  const int64_t second_snapshot = layout->shard_numel() * 2;
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    ASSERT_TRUE(status.ok()) << status.status();
    // The servers' tier: host here, another where FLATSHARD_TEST_MEMORY names one.
    const auto planned = cli::BuffersFor({.optimizer = "adam",
                                          .workers = workers / replicas,
                                          .grad_dtype = "bfloat16",
                                          .gather_dtype = "bfloat16",
                                          .replica_groups = replicas,
                                          .memory = status->memory()});
    ASSERT_TRUE(planned.ok()) << planned.status();
    ASSERT_EQ(status->groups_size(), 1);
    const int replica = status->groups(0).replica();
    const int64_t bytes = cli::PlannedBytesPerServer(*layout, *planned, replica);
    EXPECT_LE(bytes, cli::PlannedBytesPerServer(*layout, *planned));
    const int64_t held = status->groups(0).bytes();
    EXPECT_TRUE(held == bytes || held == bytes + second_snapshot)
        << "server " << status->rank() << " (replica group " << replica << ") holds " << held
        << " bytes; flatshard layout plans " << bytes;
  }
}

TEST(StatusCommandTest, AGroupsMemoryIsWhatFlatshardLayoutPlans) { ExpectHeldAsPlanned(2, 1, 3); }

// Three replica groups of two servers: the shards of 1054 elements are cut into chunks of
// 348, 352 and 354, so the servers of each replica group hold different exchange buffers.
TEST(StatusCommandTest, AHybridGroupsMemoryIsWhatFlatshardLayoutPlans) { ExpectHeldAsPlanned(6, 3, 6); }

// Job "status" of one worker (`client`), with group "g" (1000 fp32, SGD) initialized and
// saved as SHARDED checkpoint "s".
void SaveAGroup(const testing::TestCluster& cluster, std::unique_ptr<Client>& client) {
  auto connected = cluster.Connect(0, 1, "status");
  ASSERT_TRUE(connected.ok()) << connected.status();
  client = *std::move(connected);
  ASSERT_TRUE(client->ConfigureJob({}).ok());
  ASSERT_TRUE(client->RegisterGroup("g", {{"w", {1000}, DType::kFloat32}}, 0, SgdOptions{}).ok());
  ASSERT_TRUE(client->InitGroupFromSeed("g", 1).ok());
  ASSERT_TRUE(client->SaveCheckpoint("s", CheckpointKind::kSharded, false).ok());
}

// A load whose COMMIT reached server 0 only (sent here by hand) leaves the group in
// different states on the two servers: the table's load column shows it and a line says
// so. A load through the client then commits on both under one id.
TEST(StatusCommandTest, AGroupLoadedOnSomeServersOnlyIsReported) {
  const testing::ScratchDir root("status-split-load");
  testing::TestCluster cluster(2, "status-token", ::testing::TempDir(), root.path());
  std::unique_ptr<Client> client;
  ASSERT_NO_FATAL_FAILURE(SaveAGroup(cluster, client));
  ASSERT_TRUE(cluster.LoadOnSome("status", "s", 0x5eed, {0}).ok());
  const cli::StatusCommandOptions options{.servers = cluster.addresses(), .token = cluster.token()};
  std::ostringstream split, err;
  ASSERT_EQ(cli::RunStatusCommand(options, split, err), 0) << err.str();
  EXPECT_EQ(Row(split.str(), "0", "status/g").back(), "5eed") << split.str();
  EXPECT_EQ(Row(split.str(), "1", "status/g").back(), "-") << split.str();
  EXPECT_NE(split.str().find("status/g: its servers hold the states of different checkpoint loads (- on rank 1; 5eed "
                             "on rank 0): a load did not commit on every server, or a server restarted since; load the "
                             "checkpoint again"),
            std::string::npos)
      << split.str();

  // Past max_group_rows the groups are not listed, yet fetched to name the split group:
  // the job's load digests differ between the servers.
  cli::StatusCommandOptions unlisted = options;
  unlisted.max_group_rows = 0;
  std::ostringstream summed;
  ASSERT_EQ(cli::RunStatusCommand(unlisted, summed, err), 0) << err.str();
  EXPECT_EQ(summed.str().find("job/group"), std::string::npos) << summed.str();
  EXPECT_NE(summed.str().find("status/g: its servers hold the states of different checkpoint loads (- on rank 1; "
                              "5eed on rank 0)"),
            std::string::npos)
      << summed.str();

  ASSERT_TRUE(client->LoadCheckpoint("s").ok());
  std::ostringstream whole, whole_summed;
  ASSERT_EQ(cli::RunStatusCommand(options, whole, err), 0) << err.str();
  ASSERT_EQ(cli::RunStatusCommand(unlisted, whole_summed, err), 0) << err.str();
  EXPECT_EQ(whole_summed.str().find("different checkpoint loads"), std::string::npos) << whole_summed.str();
  const std::string load = Row(whole.str(), "0", "status/g").back();
  EXPECT_NE(load, "-");
  EXPECT_NE(load, "5eed");
  EXPECT_EQ(Row(whole.str(), "1", "status/g").back(), load) << whole.str();
  EXPECT_EQ(whole.str().find("different checkpoint loads"), std::string::npos) << whole.str();
}

// A load prepared on every server whose client never commits it (sent here by hand) is
// listed with its memory until --staged_load_timeout drops it; its late commit says why
// and changes nothing. Loads name themselves from their preparation on.
TEST(StatusCommandTest, ALoadNeverCommittedIsListedUntilItsTimeoutDropsIt) {
  const testing::ScratchDir root("status-staged-load");
  testing::TestCluster cluster(2, "status-token", ::testing::TempDir(), root.path(),
                               {{"--staged_load_timeout=3s"}, {"--staged_load_timeout=3s"}});
  std::unique_ptr<Client> client;
  ASSERT_NO_FATAL_FAILURE(SaveAGroup(cluster, client));
  const absl::Status unnamed = cluster.LoadPhase(0, "status", "s", 0, v1::LoadCheckpointRequest::PREPARE);
  EXPECT_EQ(unnamed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unnamed.message(), "a load must carry its (non-zero) load_id in every phase");
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(cluster.LoadPhase(rank, "status", "s", 0x5eed, v1::LoadCheckpointRequest::PREPARE).ok());
  }
  const cli::StatusCommandOptions options{.servers = cluster.addresses(), .token = cluster.token()};
  std::ostringstream staged, err;
  ASSERT_EQ(cli::RunStatusCommand(options, staged, err), 0) << err.str();
  for (int rank = 0; rank < 2; ++rank) {
    // Each server stages its shard of 500 fp32 parameters.
    EXPECT_NE(staged.str().find(absl::StrCat("server ", rank, ": checkpoint 's' staged for job 'status' as load 5eed: ",
                                             cli::HumanBytes(2000), ", waiting ")),
              std::string::npos)
        << staged.str();
  }

  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  std::ostringstream dropped;
  do {
    absl::SleepFor(absl::Milliseconds(200));
    dropped.str("");
    ASSERT_EQ(cli::RunStatusCommand(options, dropped, err), 0) << err.str();
  } while (dropped.str().find("staged for job") != std::string::npos && absl::Now() < deadline);
  EXPECT_EQ(dropped.str().find("staged for job"), std::string::npos) << dropped.str();
  const absl::Status late = cluster.LoadPhase(1, "status", "s", 0x5eed, v1::LoadCheckpointRequest::COMMIT);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(late.message(),
            "checkpoint 's' was not prepared for loading here as load 5eed: its staging was dropped (no "
            "commit came within 3s of its staging or last renewal (--staged_load_timeout))");
  EXPECT_EQ(Row(dropped.str(), "1", "status/g").back(), "-") << dropped.str();
  ASSERT_TRUE(client->LoadCheckpoint("s").ok());
}

// A status asked without groups (as the checkpoint calls ask it, polling a save's
// progress) leaves out the groups and nothing else that a caller reads: the jobs, the
// checkpoint root, the loads staged here.
TEST(StatusCommandTest, AStatusWithoutGroupsHasAllButThem) {
  const testing::ScratchDir root("status-without-groups");
  testing::TestCluster cluster(2, "status-token", ::testing::TempDir(), root.path());
  std::unique_ptr<Client> client;
  ASSERT_NO_FATAL_FAILURE(SaveAGroup(cluster, client));
  ASSERT_TRUE(cluster.LoadPhase(0, "status", "s", 0x5eed, v1::LoadCheckpointRequest::PREPARE).ok());
  ASSERT_TRUE(client->RegisterGroup("h", {{"v", {10}, DType::kFloat32}}, 0, SgdOptions{}).ok());
  // g steps once, h never: the job's summary spans versions 0 to 1 and both groups.
  const std::vector<float> grad(1000, 1.0f);
  const auto grad_bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(grad.data()), 4000);
  ASSERT_TRUE(client->Scatter("g", 0, DType::kFloat32, grad_bytes).get().ok());
  ASSERT_TRUE(client->WaitVersion("g", 1).ok());
  const ClientOptions options{.servers = cluster.addresses(), .token = cluster.token()};
  v1::GetStatusRequest request;
  request.set_omit_groups(true);
  const auto without = FetchClusterStatus(options, {}, request);
  const auto with = FetchClusterStatus(options);
  request.set_summarize_groups(true);
  const auto summed_up = FetchClusterStatus(options, {}, request);
  ExpectSummariesOfTheirGroups(with, summed_up);
  for (const auto& status : summed_up) {
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->jobs(0).summary().groups(), 2);
    EXPECT_EQ(status->jobs(0).summary().max_version(), 1);
  }
  // h steps twice, past g: the other group now holds the lowest version and the highest.
  const std::vector<float> small_grad(10, 1.0f);
  for (const int64_t version : {0, 1}) {
    ASSERT_TRUE(client
                    ->Scatter("h", version, DType::kFloat32,
                              absl::MakeConstSpan(reinterpret_cast<const std::byte*>(small_grad.data()), 40))
                    .get()
                    .ok());
    ASSERT_TRUE(client->WaitVersion("h", version + 1).ok());
  }
  ExpectSummariesOfTheirGroups(FetchClusterStatus(options), FetchClusterStatus(options, {}, request));
  ASSERT_EQ(without.size(), 2u);
  ASSERT_EQ(with.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(without[rank].ok()) << without[rank].status();
    ASSERT_TRUE(with[rank].ok()) << with[rank].status();
    const v1::ServerStatus& brief = *without[rank];
    const v1::ServerStatus& full = *with[rank];
    EXPECT_EQ(brief.groups_size(), 0);
    EXPECT_EQ(full.groups_size(), 2);
    EXPECT_EQ(brief.rank(), rank);
    EXPECT_EQ(brief.control_address(), full.control_address());
    ASSERT_EQ(brief.jobs_size(), 1);
    EXPECT_EQ(brief.jobs(0).SerializeAsString(), full.jobs(0).SerializeAsString());
    EXPECT_FALSE(brief.checkpoint_root_id().empty());
    EXPECT_EQ(brief.checkpoint_root_id(), full.checkpoint_root_id());
    EXPECT_EQ(brief.gathers(), full.gathers());
    ASSERT_EQ(brief.staged_loads_size(), rank == 0 ? 1 : 0);
    ASSERT_EQ(full.staged_loads_size(), rank == 0 ? 1 : 0);
    if (rank == 0) {
      EXPECT_EQ(brief.staged_loads(0).load_id(), 0x5eedu);
    }
  }
}

}  // namespace
}  // namespace flatshard
