// `flatshard status`'s latency quantiles (client/cli/latency_table.h) against the exact
// quantiles of the durations the histogram counted.
#include "client/cli/latency_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace flatshard::cli {
namespace {

// The server's bounds in seconds (server/latency_histogram.h), restated for independence.
const std::vector<double> kBounds = {10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3,   2.5e-3,
                                     5e-3,  10e-3, 25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,
                                     2.5,   5.0,   10.0,  30.0,   60.0,   120.0,  300.0};

// The bucket of `seconds` by a linear scan: the first bound it does not exceed.
size_t BucketOf(double seconds) {
  size_t bucket = 0;
  while (bucket < kBounds.size() && seconds > kBounds[bucket]) ++bucket;
  return bucket;
}

v1::LatencyHistogram HistogramOf(const std::vector<double>& durations) {
  v1::LatencyHistogram histogram;
  for (double bound : kBounds) histogram.add_upper_bounds_seconds(bound);
  std::vector<uint64_t> counts(kBounds.size() + 1, 0);
  for (double d : durations) {
    ++counts[BucketOf(d)];
    histogram.set_sum_seconds(histogram.sum_seconds() + d);
  }
  histogram.mutable_counts()->Add(counts.begin(), counts.end());
  histogram.set_count(durations.size());
  return histogram;
}

TEST(LatencyQuantileTest, FallsInTheBucketOfTheExactQuantile) {
  std::mt19937_64 random(20261124);
  for (int trial = 0; trial < 50; ++trial) {
    // Log-uniform between 10 us and 10 s, centred somewhere different each trial.
    const double centre = std::uniform_real_distribution<double>(std::log(1e-4), std::log(1.0))(random);
    std::normal_distribution<double> log_seconds(centre, 1.5);
    std::vector<double> durations(1 + random() % 2000);
    for (double& d : durations) d = std::clamp(std::exp(log_seconds(random)), 10e-6, 10.0);
    const v1::LatencyHistogram histogram = HistogramOf(durations);
    std::sort(durations.begin(), durations.end());
    for (double q : {0.0, 0.1, 0.5, 0.9, 0.99, 1.0}) {
      // The exact quantile, nearest rank.
      const size_t rank = std::max<size_t>(1, static_cast<size_t>(std::ceil(q * durations.size())));
      const double exact = durations[rank - 1];
      const size_t bucket = BucketOf(exact);
      const double lower = bucket == 0 ? 0.0 : kBounds[bucket - 1];
      const double estimate = LatencyQuantile(histogram, q);
      EXPECT_GE(estimate, lower) << "q " << q << ", exact " << exact << ", trial " << trial;
      EXPECT_LE(estimate, kBounds[bucket]) << "q " << q << ", exact " << exact << ", trial " << trial;
    }
  }
}

TEST(LatencyQuantileTest, InterpolatesWithinABucketAndStopsAtTheLastBound) {
  // Four durations in (1 ms, 2.5 ms]: the median is halfway through that bucket.
  EXPECT_DOUBLE_EQ(LatencyQuantile(HistogramOf({1.1e-3, 1.2e-3, 2e-3, 2.4e-3}), 0.5), 1.75e-3);
  // Half up to 10 us, half in (50 us, 100 us]: p75 is halfway through that bucket, p25
  // halfway through the first, which starts at 0.
  EXPECT_DOUBLE_EQ(LatencyQuantile(HistogramOf({1e-6, 2e-6, 60e-6, 90e-6}), 0.75), 75e-6);
  EXPECT_DOUBLE_EQ(LatencyQuantile(HistogramOf({1e-6, 2e-6, 60e-6, 90e-6}), 0.25), 5e-6);
  // Above every bound: the last bound, as Prometheus answers.
  EXPECT_EQ(LatencyQuantile(HistogramOf({400.0, 500.0}), 0.5), 300.0);
  EXPECT_EQ(LatencyQuantile(HistogramOf({}), 0.5), 0.0);
}

TEST(HumanSecondsTest, PicksTheUnit) {
  EXPECT_EQ(HumanSeconds(2.5e-6), "2.5 us");
  EXPECT_EQ(HumanSeconds(850e-6), "850 us");
  EXPECT_EQ(HumanSeconds(12.5e-3), "12.5 ms");
  EXPECT_EQ(HumanSeconds(3.2), "3.20 s");
}

}  // namespace
}  // namespace flatshard::cli
