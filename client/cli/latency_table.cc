#include "client/cli/latency_table.h"

#include <algorithm>
#include <ostream>

#include "absl/strings/str_format.h"

namespace flatshard::cli {

double LatencyQuantile(const v1::LatencyHistogram& histogram, double q) {
  if (histogram.count() == 0 || histogram.upper_bounds_seconds_size() == 0) return 0;
  const double rank = std::clamp(q, 0.0, 1.0) * static_cast<double>(histogram.count());
  double below = 0;  // durations in the buckets before this one
  for (int i = 0; i < histogram.counts_size(); ++i) {
    const double in_bucket = static_cast<double>(histogram.counts(i));
    if (i >= histogram.upper_bounds_seconds_size()) break;  // above every bound
    if (below + in_bucket >= rank && in_bucket > 0) {
      const double lower = i == 0 ? 0.0 : histogram.upper_bounds_seconds(i - 1);
      const double upper = histogram.upper_bounds_seconds(i);
      return lower + (upper - lower) * (rank - below) / in_bucket;
    }
    below += in_bucket;
  }
  return histogram.upper_bounds_seconds(histogram.upper_bounds_seconds_size() - 1);
}

std::string HumanSeconds(double seconds) {
  if (seconds < 10e-6) return absl::StrFormat("%.1f us", seconds * 1e6);
  if (seconds < 1e-3) return absl::StrFormat("%.0f us", seconds * 1e6);
  if (seconds < 1.0) return absl::StrFormat("%.3g ms", seconds * 1e3);
  return absl::StrFormat("%.2f s", seconds);
}

void PrintLatencyTable(const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses, bool per_group,
                       std::ostream& out) {
  bool header = false;
  // A quantile in the first bucket is only known to be below its bound.
  auto quantile = [](const v1::LatencyHistogram& h, double q) {
    const double seconds = LatencyQuantile(h, q);
    return h.upper_bounds_seconds_size() > 0 && seconds <= h.upper_bounds_seconds(0)
               ? "<" + HumanSeconds(h.upper_bounds_seconds(0))
               : HumanSeconds(seconds);
  };
  auto row = [&](int rank, const std::string& what, const v1::LatencyHistogram& h) {
    if (h.count() == 0) return;
    if (!header) {
      // Server side: a gather's time includes its wait for the version, a sync
      // scatter's the step it completes.
      out << absl::StrFormat("\n%-4s %-38s %10s %10s %10s %10s\n", "rank", "server-side time of", "count", "p50", "p99",
                             "mean");
      header = true;
    }
    out << absl::StrFormat("%-4d %-38s %10d %10s %10s %10s\n", rank, what, h.count(), quantile(h, 0.5),
                           quantile(h, 0.99), HumanSeconds(h.sum_seconds() / static_cast<double>(h.count())));
  };
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::NamedLatency& op : status->data_request_seconds()) row(status->rank(), op.name(), op.seconds());
    if (per_group) {
      for (const v1::GroupStatus& g : status->groups()) {
        const std::string group = g.job() + "/" + g.group();
        row(status->rank(), "reduce " + group, g.reduce_seconds());
        row(status->rank(), "optimizer " + group, g.optimizer_seconds());
      }
      continue;
    }
    for (const v1::JobStatus& job : status->jobs()) {
      row(status->rank(), "reduce " + job.job() + "/*", job.summary().reduce_seconds());
      row(status->rank(), "optimizer " + job.job() + "/*", job.summary().optimizer_seconds());
    }
  }
}

}  // namespace flatshard::cli
