// The latency part of `flatshard status`: quantiles estimated from the servers' histograms
// (v1::LatencyHistogram) and the table that prints them. Pure; thread-safe.
#ifndef FLATSHARD_CLIENT_CLI_LATENCY_TABLE_H_
#define FLATSHARD_CLIENT_CLI_LATENCY_TABLE_H_

#include <iosfwd>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/flatshard.pb.h"

namespace flatshard::cli {

// The `q` quantile (0 <= q <= 1) of the durations `histogram` counts, in seconds, as
// Prometheus' histogram_quantile estimates it: linear within the bucket the quantile
// falls in (the first bucket starts at 0); the last bound when it falls above every
// bound. 0 for an empty histogram.
double LatencyQuantile(const v1::LatencyHistogram& histogram, double q);

// "2.5 us", "850 us", "12.5 ms", "3.20 s".
std::string HumanSeconds(double seconds);

// Per server: each data-plane op that came, and each group's reduction and optimizer
// step (`per_group`, from the statuses' groups; otherwise one row per job, "reduce
// job/*", from its summary of its groups on that server: GetStatusRequest.summarize_groups),
// with count, p50, p99 and mean (RPCs are in --json and the metrics); a quantile in the
// first bucket shows as "<10 us". Nothing when no server has any.
void PrintLatencyTable(const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses, bool per_group,
                       std::ostream& out);

}  // namespace flatshard::cli

#endif  // FLATSHARD_CLIENT_CLI_LATENCY_TABLE_H_
