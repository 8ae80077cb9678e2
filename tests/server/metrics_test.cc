#include "server/metrics.h"

#include <gtest/gtest.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <map>
#include <string>

namespace flatshard::server {
namespace {

// family name -> {labels as "k=v,k=v" -> value}
std::map<std::string, std::map<std::string, double>> ByName(const std::vector<prometheus::MetricFamily>& families) {
  std::map<std::string, std::map<std::string, double>> out;
  for (const prometheus::MetricFamily& family : families) {
    auto& samples = out[family.name];
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::string labels;
      for (const auto& label : metric.label) labels += (labels.empty() ? "" : ",") + label.name + "=" + label.value;
      samples[labels] = family.type == prometheus::MetricType::Counter ? metric.counter.value : metric.gauge.value;
    }
  }
  return out;
}

TEST(StatusMetricsTest, SplitsRequestsByPlaneAndLabelsJobsGroupsAndLoads) {
  v1::ServerStatus status;
  status.set_rank(3);
  status.set_memory("device");
  status.set_gathers(10);
  status.set_ipc_gathers(3);
  status.set_nccl_gathers(5);
  status.set_scatters(7);
  status.set_nccl_scatters(7);
  status.set_bytes_sent(1 << 20);
  status.set_exchange_bytes_received(4096);
  status.set_cluster_check("checking");
  v1::JobStatus* clipped = status.add_jobs();
  clipped->set_job("a");
  clipped->set_num_workers(4);
  clipped->set_last_norm_step(6);
  clipped->set_last_grad_norm(2.5);
  clipped->set_skipped_steps(1);
  v1::JobStatus* plain = status.add_jobs();
  plain->set_job("b");
  plain->set_num_workers(2);
  plain->set_last_norm_step(-1);
  v1::GroupStatus* group = status.add_groups();
  group->set_job("a");
  group->set_group("mlp");
  group->set_version(7);
  group->set_bytes(123456);
  group->set_shard_numel(1000);
  group->set_pending_contributions(2);
  v1::StagedLoad* staged = status.add_staged_loads();
  staged->set_job("a");
  staged->set_name("ckpt");
  staged->set_bytes(8000);

  const std::vector<prometheus::MetricFamily> families = StatusMetrics(status);
  auto metrics = ByName(families);
  EXPECT_EQ(metrics["flatshard_gathers_total"],
            (std::map<std::string, double>{{"plane=tcp", 2}, {"plane=ipc", 3}, {"plane=nccl", 5}}));
  EXPECT_EQ(metrics["flatshard_scatters_total"],
            (std::map<std::string, double>{{"plane=tcp", 0}, {"plane=ipc", 0}, {"plane=nccl", 7}}));
  EXPECT_EQ(metrics["flatshard_sent_bytes_total"]["to=workers"], 1 << 20);
  EXPECT_EQ(metrics["flatshard_received_bytes_total"]["from=peers"], 4096);
  EXPECT_EQ(metrics["flatshard_cluster_agreed"][""], 0);
  EXPECT_EQ(metrics["flatshard_job_workers"], (std::map<std::string, double>{{"job=a", 4}, {"job=b", 2}}));
  // Job b has no norm yet: no sample rather than a made-up 0.
  EXPECT_EQ(metrics["flatshard_job_last_grad_norm"], (std::map<std::string, double>{{"job=a", 2.5}}));
  EXPECT_EQ(metrics["flatshard_job_last_grad_norm_step"], (std::map<std::string, double>{{"job=a", 6}}));
  EXPECT_EQ(metrics["flatshard_group_version"]["job=a,group=mlp"], 7);
  EXPECT_EQ(metrics["flatshard_group_bytes"]["job=a,group=mlp"], 123456);
  EXPECT_EQ(metrics["flatshard_group_pending_contributions"]["job=a,group=mlp"], 2);
  EXPECT_EQ(metrics["flatshard_staged_load_bytes"]["job=a,checkpoint=ckpt"], 8000);
  EXPECT_EQ(metrics.count("flatshard_checkpoint_done_bytes"), 0u);  // nothing in progress: no family
  EXPECT_EQ(metrics["flatshard_server_info"].begin()->first.substr(0, 20), "rank=3,memory=device");

  // What Prometheus reads: the text format, with HELP and TYPE per family.
  const std::string text = prometheus::TextSerializer().Serialize(families);
  EXPECT_NE(text.find("# TYPE flatshard_gathers_total counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flatshard_group_version{job=\"a\",group=\"mlp\"} 7\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace flatshard::server
