// Deleting a job whose training is over, against real servers: its groups and their
// memory go, its workers' waits end with NotFound, other jobs train on, and the name can
// be configured again with other settings (`flatshard delete-job` and Client::DeleteJob).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <thread>

#include "absl/time/clock.h"
#include "client/cli/job_command.h"
#include "client/cluster_status.h"
#include "tests/integration/test_cluster.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

absl::Span<const std::byte> Bytes(const std::vector<float>& values) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(values.data()), values.size() * sizeof(float));
}

// The memory the servers report for `job`'s groups, and whether any server lists it.
std::pair<int64_t, bool> JobOnServers(const testing::TestCluster& cluster, const std::string& job) {
  int64_t bytes = 0;
  bool listed = false;
  for (const auto& status : FetchClusterStatus({.servers = cluster.addresses(), .token = cluster.token()})) {
    EXPECT_TRUE(status.ok()) << status.status();
    if (!status.ok()) continue;
    for (const v1::GroupStatus& g : status->groups()) {
      if (g.job() == job) bytes += g.bytes();
    }
    for (const v1::JobStatus& j : status->jobs()) listed |= j.job() == job;
  }
  return {bytes, listed};
}

TEST(DeleteJobTest, AFinishedJobGoesWithItsMemoryWhileAnotherTrainsOn) {
  testing::TestCluster cluster(2, "delete-token", ::testing::TempDir());
  const std::vector<TensorSpec> tensors = {{"w", {4000}, DType::kFloat32}};
  const std::vector<float> grad(4000, 0.5f);

  // "busy" trains throughout; "done" is clipped, with a worker that never sends.
  auto busy = cluster.Connect(0, 1, "busy");
  ASSERT_TRUE(busy.ok()) << busy.status();
  ASSERT_TRUE((*busy)->ConfigureJob({}).ok());
  ASSERT_TRUE((*busy)->RegisterGroup("g", tensors, 0, SgdOptions{.lr = 0.1}).ok());
  std::vector<std::unique_ptr<Client>> done;
  for (int rank = 0; rank < 2; ++rank) {
    auto client = cluster.Connect(rank, 2, "done");
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->ConfigureJob({.max_grad_norm = 1.0}).ok());
    ASSERT_TRUE((*client)->RegisterGroup("g", tensors, 0, AdamOptions{}).ok());
    done.push_back(*std::move(client));
  }
  ASSERT_TRUE(done[0]->Scatter("g", 0, DType::kFloat32, Bytes(grad)).get().ok());
  ASSERT_TRUE((*busy)->Scatter("g", 0, DType::kFloat32, Bytes(grad)).get().ok());
  const auto [held, listed] = JobOnServers(cluster, "done");
  ASSERT_GT(held, 0);
  ASSERT_TRUE(listed);

  // Worker 0 waits for version 1 and for the norm of step 0; neither can come.
  absl::Status waited, norm;
  std::thread version_waiter([&] { waited = done[0]->WaitVersion("g", 1).status(); });
  std::thread norm_waiter([&] { norm = done[0]->GradNorm(0).status(); });
  absl::SleepFor(absl::Milliseconds(200));

  const absl::Time deleted_at = absl::Now();
  std::ostringstream out, err;
  ASSERT_EQ(
      cli::RunDeleteJobCommand({.servers = cluster.addresses(), .token = cluster.token(), .job = "done"}, out, err), 0)
      << err.str();
  EXPECT_THAT(out.str(), HasSubstr("deleted job 'done'"));
  version_waiter.join();
  norm_waiter.join();
  EXPECT_LT(absl::Now() - deleted_at, absl::Seconds(10)) << "the waits ran to their deadlines";
  EXPECT_EQ(waited.code(), absl::StatusCode::kNotFound) << waited;
  EXPECT_EQ(norm.code(), absl::StatusCode::kNotFound) << norm;
  EXPECT_EQ(JobOnServers(cluster, "done"), std::make_pair(int64_t{0}, false));

  // Its workers' requests are refused; the other job trains on.
  const absl::Status late = done[1]->Scatter("g", 0, DType::kFloat32, Bytes(grad)).get();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound) << late;
  ASSERT_TRUE((*busy)->Scatter("g", 1, DType::kFloat32, Bytes(grad)).get().ok());
  EXPECT_EQ(*(*busy)->WaitVersion("g", 2), 2);

  // A second delete finds nothing; the name is free for other settings.
  EXPECT_EQ(done[0]->DeleteJob().status().code(), absl::StatusCode::kNotFound);
  out.str("");
  err.str("");
  EXPECT_EQ(
      cli::RunDeleteJobCommand({.servers = cluster.addresses(), .token = cluster.token(), .job = "done"}, out, err), 1);
  EXPECT_THAT(err.str(), HasSubstr("job 'done' is configured on no server"));
  auto again = cluster.Connect(0, 3, "done");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)->ConfigureJob({}).ok()) << "the old settings still hold the name";
  ASSERT_TRUE((*again)->RegisterGroup("g", tensors, 0, SgdOptions{}).ok());
  EXPECT_EQ(*(*again)->WaitVersion("g", 0), 0);
  // The deleting client reports what the servers held.
  absl::StatusOr<int64_t> freed = (*again)->DeleteJob();
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(*freed, 0);

  std::ostringstream usage_out, usage_err;
  EXPECT_EQ(cli::RunDeleteJobCommand({.servers = cluster.addresses(), .token = cluster.token()}, usage_out, usage_err),
            2);
  EXPECT_THAT(usage_err.str(), HasSubstr("--job is required"));
}

}  // namespace
}  // namespace flatshard
