// LatencyHistogram and NamedLatencies (server/latency_histogram.h): Prometheus' "le"
// buckets, the sum in whole nanoseconds, nothing lost to concurrent records, one
// histogram per name.
#include "server/latency_histogram.h"

#include <gtest/gtest.h>

#include <numeric>
#include <thread>
#include <vector>

#include "absl/time/time.h"

namespace flatshard::server {
namespace {

v1::LatencyHistogram Snapshot(const LatencyHistogram& histogram) {
  v1::LatencyHistogram proto;
  histogram.ToProto(&proto);
  return proto;
}

TEST(LatencyHistogramTest, ADurationLandsInTheFirstBucketWhoseBoundItDoesNotExceed) {
  LatencyHistogram histogram;
  histogram.Record(absl::Microseconds(50));     // on the third bound: bucket 2
  histogram.Record(absl::Nanoseconds(50'001));  // just above it: bucket 3
  histogram.Record(absl::ZeroDuration());       // bucket 0
  histogram.Record(absl::Milliseconds(3));      // (2.5 ms, 5 ms]: bucket 8
  histogram.Record(absl::Seconds(300));         // the last bound
  histogram.Record(absl::Seconds(301));         // above every bound
  histogram.Record(-absl::Seconds(1));          // counts as 0: bucket 0, nothing off the sum
  const v1::LatencyHistogram proto = Snapshot(histogram);
  ASSERT_EQ(proto.upper_bounds_seconds_size(), static_cast<int>(kLatencyBoundsSeconds.size()));
  ASSERT_EQ(proto.counts_size(), proto.upper_bounds_seconds_size() + 1);
  std::vector<uint64_t> expected(proto.counts_size(), 0);
  expected[0] = 2;
  expected[2] = 1;
  expected[3] = 1;
  expected[8] = 1;
  expected[proto.upper_bounds_seconds_size() - 1] = 1;
  expected[proto.upper_bounds_seconds_size()] = 1;
  EXPECT_EQ(std::vector<uint64_t>(proto.counts().begin(), proto.counts().end()), expected);
  EXPECT_EQ(proto.upper_bounds_seconds(8), 5e-3);
  EXPECT_EQ(proto.count(), 7u);
  EXPECT_DOUBLE_EQ(proto.sum_seconds(), 50e-6 + 50.001e-6 + 3e-3 + 300 + 301);
}

// A job's groups summed up (JobGroupsSummary): the histogram of all their durations, as
// if one had counted them.
TEST(LatencyHistogramTest, AddedUpTheyCountEveryDurationOfEach) {
  const std::vector<absl::Duration> first = {absl::Microseconds(3), absl::Microseconds(40), absl::Milliseconds(2),
                                             absl::Seconds(7)};
  const std::vector<absl::Duration> second = {absl::Microseconds(40), absl::Milliseconds(300), absl::Seconds(400)};
  LatencyHistogram one, other, empty, both;
  for (const absl::Duration d : first) one.Record(d);
  for (const absl::Duration d : second) other.Record(d);
  for (const auto* durations : {&first, &second}) {
    for (const absl::Duration d : *durations) both.Record(d);
  }
  v1::LatencyHistogram sum;
  for (const LatencyHistogram* histogram : {&one, &empty, &other}) histogram->AddTo(&sum);
  const v1::LatencyHistogram expected = Snapshot(both);
  EXPECT_EQ(sum.count(), 7u);
  EXPECT_EQ(std::vector<double>(sum.upper_bounds_seconds().begin(), sum.upper_bounds_seconds().end()),
            std::vector<double>(kLatencyBoundsSeconds.begin(), kLatencyBoundsSeconds.end()));
  EXPECT_EQ(std::vector<uint64_t>(sum.counts().begin(), sum.counts().end()),
            std::vector<uint64_t>(expected.counts().begin(), expected.counts().end()));
  EXPECT_DOUBLE_EQ(sum.sum_seconds(), expected.sum_seconds());
}

TEST(LatencyHistogramTest, ConcurrentRecordsAreAllCounted) {
  LatencyHistogram histogram;
  constexpr int kThreads = 4, kEach = 20'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) histogram.Record(absl::Microseconds(5 + 1000 * t));
    });
  }
  for (std::thread& thread : threads) thread.join();
  const v1::LatencyHistogram proto = Snapshot(histogram);
  EXPECT_EQ(proto.count(), uint64_t{kThreads} * kEach);
  EXPECT_EQ(std::accumulate(proto.counts().begin(), proto.counts().end(), uint64_t{0}), proto.count());
  // 5 us, 1.005 ms, 2.005 ms, 3.005 ms: buckets 0, 7, 7 and 8.
  EXPECT_EQ(proto.counts(0), uint64_t{kEach});
  EXPECT_EQ(proto.counts(7), uint64_t{2 * kEach});
  EXPECT_EQ(proto.counts(8), uint64_t{kEach});
  EXPECT_NEAR(proto.sum_seconds(), kEach * (5e-6 + 1005e-6 + 2005e-6 + 3005e-6), 1e-9);
}

TEST(NamedLatenciesTest, OneHistogramPerNameListedByNameOnceRecorded) {
  NamedLatencies latencies;
  LatencyHistogram& scatter = latencies.For("scatter");
  EXPECT_EQ(&latencies.For("scatter"), &scatter);
  latencies.For("gather").Record(absl::Milliseconds(1));
  scatter.Record(absl::Milliseconds(2));
  scatter.Record(absl::Milliseconds(2));
  (void)latencies.For("never-recorded");
  google::protobuf::RepeatedPtrField<v1::NamedLatency> proto;
  latencies.ToProto(&proto);
  ASSERT_EQ(proto.size(), 2);
  EXPECT_EQ(proto[0].name(), "gather");
  EXPECT_EQ(proto[0].seconds().count(), 1u);
  EXPECT_EQ(proto[1].name(), "scatter");
  EXPECT_EQ(proto[1].seconds().count(), 2u);
  EXPECT_DOUBLE_EQ(proto[1].seconds().sum_seconds(), 4e-3);
}

}  // namespace
}  // namespace flatshard::server
