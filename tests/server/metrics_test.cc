#include "server/metrics.h"

#include <gtest/gtest.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <cmath>
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
  status.set_data_requests_in_flight(2);
  status.set_rpcs_in_flight(1);
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
  EXPECT_EQ(metrics["flatshard_requests_in_flight"],
            (std::map<std::string, double>{{"plane=data", 2}, {"plane=control", 1}}));
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

// Latency histograms (v1::LatencyHistogram, per bucket) become Prometheus histograms:
// cumulative buckets ending at +Inf with every duration, their sum and count.
TEST(StatusMetricsTest, LatenciesAreCumulativeHistograms) {
  v1::LatencyHistogram histogram;
  histogram.add_upper_bounds_seconds(0.001);
  histogram.add_upper_bounds_seconds(0.01);
  for (uint64_t count : {3, 0, 2}) histogram.add_counts(count);
  histogram.set_count(5);
  histogram.set_sum_seconds(0.5);
  v1::ServerStatus status;
  v1::NamedLatency* gather = status.add_data_request_seconds();
  gather->set_name("gather");
  *gather->mutable_seconds() = histogram;
  v1::NamedLatency* rpc = status.add_rpc_seconds();
  rpc->set_name("flatshard.v1.Flatshard/GetStatus");
  *rpc->mutable_seconds() = histogram;
  v1::GroupStatus* group = status.add_groups();
  group->set_job("a");
  group->set_group("mlp");
  *group->mutable_optimizer_seconds() = histogram;  // and reduce_seconds empty

  const std::vector<prometheus::MetricFamily> families = StatusMetrics(status);
  std::map<std::string, const prometheus::MetricFamily*> by_name;
  for (const prometheus::MetricFamily& family : families) by_name[family.name] = &family;
  for (const char* name : {"flatshard_data_request_duration_seconds", "flatshard_rpc_duration_seconds",
                           "flatshard_group_optimizer_duration_seconds"}) {
    ASSERT_TRUE(by_name.contains(name)) << name;
    const prometheus::MetricFamily& family = *by_name[name];
    EXPECT_EQ(family.type, prometheus::MetricType::Histogram) << name;
    ASSERT_EQ(family.metric.size(), 1u) << name;
    const prometheus::ClientMetric::Histogram& h = family.metric[0].histogram;
    EXPECT_EQ(h.sample_count, 5u);
    EXPECT_EQ(h.sample_sum, 0.5);
    ASSERT_EQ(h.bucket.size(), 3u);
    EXPECT_EQ(h.bucket[0].cumulative_count, 3u);
    EXPECT_EQ(h.bucket[0].upper_bound, 0.001);
    EXPECT_EQ(h.bucket[1].cumulative_count, 3u);
    EXPECT_EQ(h.bucket[2].cumulative_count, 5u);
    EXPECT_TRUE(std::isinf(h.bucket[2].upper_bound));
  }
  // An empty group histogram is still the group's (all zeros), not left out.
  ASSERT_TRUE(by_name.contains("flatshard_group_reduce_duration_seconds"));
  EXPECT_EQ(by_name["flatshard_group_reduce_duration_seconds"]->metric[0].histogram.sample_count, 0u);

  const std::string text = prometheus::TextSerializer().Serialize(families);
  EXPECT_NE(text.find("# TYPE flatshard_data_request_duration_seconds histogram\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flatshard_data_request_duration_seconds_bucket{op=\"gather\",le=\"0.01\"} 3\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("flatshard_data_request_duration_seconds_bucket{op=\"gather\",le=\"+Inf\"} 5\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("flatshard_data_request_duration_seconds_count{op=\"gather\"} 5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flatshard_rpc_duration_seconds_sum{method=\"flatshard.v1.Flatshard/GetStatus\"} 0.5\n"),
            std::string::npos)
      << text;
  // One +Inf bucket per sample, not two.
  size_t infs = 0;
  for (size_t at = text.find("le=\"+Inf\""); at != std::string::npos; at = text.find("le=\"+Inf\"", at + 1)) ++infs;
  EXPECT_EQ(infs, 4u) << text;
}

}  // namespace
}  // namespace flatshard::server
