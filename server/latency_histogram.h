// Latencies the server measures of its own work, for GetStatus (v1::LatencyHistogram)
// and the Prometheus histograms built from it (server/metrics.h).
//
// LatencyHistogram counts durations into fixed buckets, kLatencyBoundsSeconds (10 us to
// 5 min, Prometheus' "le" rule: a duration lands in the first bucket whose bound it does
// not exceed, and above the last bound in one more), and sums them. NamedLatencies keeps
// one histogram per kind of request (a data-plane op, an RPC method), made on first use.
//
// Thread-safe. Record is lock-free (relaxed atomics): it runs on the data plane's and
// the group's hot paths; NamedLatencies::For takes a shared lock (exclusive only the first
// time a name comes). A snapshot read while others record may see a duration in its
// bucket and not yet in the sum; its count is always the sum of its buckets.
//
//   const LatencyClock::time_point start = LatencyClock::now();
//   ...
//   latencies.For("gather").RecordSince(start);
#ifndef FLATSHARD_SERVER_LATENCY_HISTOGRAM_H_
#define FLATSHARD_SERVER_LATENCY_HISTOGRAM_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/flatshard.pb.h"

namespace flatshard::server {

// From a small group's optimizer step (microseconds) and a small gather (~50 us) to a
// checkpoint RPC of minutes.
inline constexpr std::array<double, 23> kLatencyBoundsSeconds = {
    10e-6,  25e-6,  50e-6,  100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0,    2.5,    5.0,    10.0, 30.0,   60.0, 120.0, 300.0};

// Monotonic: a wall-clock step never makes a duration.
using LatencyClock = std::chrono::steady_clock;

class LatencyHistogram {
 public:
  void Record(absl::Duration duration);  // a negative one counts as 0
  void RecordSince(LatencyClock::time_point start) { Record(absl::FromChrono(LatencyClock::now() - start)); }
  void ToProto(v1::LatencyHistogram* proto) const;
  // Adds its counts and sum to `proto`'s, which is empty or has this class's buckets.
  void AddTo(v1::LatencyHistogram* proto) const;

 private:
  std::array<std::atomic<uint64_t>, kLatencyBoundsSeconds.size() + 1> counts_{};
  std::atomic<int64_t> sum_nanos_{0};
};

class NamedLatencies {
 public:
  // The histogram of `name`; the reference stays valid as long as this object.
  LatencyHistogram& For(absl::string_view name);
  // One entry per name recorded at least once, by name.
  void ToProto(google::protobuf::RepeatedPtrField<v1::NamedLatency>* proto) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<LatencyHistogram>, std::less<>> histograms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_LATENCY_HISTOGRAM_H_
