#include "server/latency_histogram.h"

#include <algorithm>

namespace flatshard::server {

void LatencyHistogram::Record(absl::Duration duration) {
  duration = std::max(duration, absl::ZeroDuration());
  const double seconds = absl::ToDoubleSeconds(duration);
  const size_t bucket =
      static_cast<size_t>(std::lower_bound(kLatencyBoundsSeconds.begin(), kLatencyBoundsSeconds.end(), seconds) -
                          kLatencyBoundsSeconds.begin());
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_nanos_.fetch_add(absl::ToInt64Nanoseconds(duration), std::memory_order_relaxed);
}

void LatencyHistogram::ToProto(v1::LatencyHistogram* proto) const {
  proto->Clear();
  AddTo(proto);
}

void LatencyHistogram::AddTo(v1::LatencyHistogram* proto) const {
  if (proto->upper_bounds_seconds_size() == 0) {
    proto->mutable_upper_bounds_seconds()->Add(kLatencyBoundsSeconds.begin(), kLatencyBoundsSeconds.end());
    proto->mutable_counts()->Resize(static_cast<int>(counts_.size()), 0);
  }
  uint64_t count = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    const uint64_t n = counts_[i].load(std::memory_order_relaxed);
    proto->set_counts(static_cast<int>(i), proto->counts(static_cast<int>(i)) + n);
    count += n;
  }
  proto->set_count(proto->count() + count);
  proto->set_sum_seconds(proto->sum_seconds() +
                         static_cast<double>(sum_nanos_.load(std::memory_order_relaxed)) * 1e-9);
}

LatencyHistogram& NamedLatencies::For(absl::string_view name) {
  {
    absl::ReaderMutexLock lock(&mu_);
    if (auto it = histograms_.find(name); it != histograms_.end()) return *it->second;
  }
  absl::MutexLock lock(&mu_);
  std::unique_ptr<LatencyHistogram>& histogram = histograms_[std::string(name)];
  if (histogram == nullptr) histogram = std::make_unique<LatencyHistogram>();
  return *histogram;
}

void NamedLatencies::ToProto(google::protobuf::RepeatedPtrField<v1::NamedLatency>* proto) const {
  proto->Clear();
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, histogram] : histograms_) {
    v1::NamedLatency* entry = proto->Add();
    entry->set_name(name);
    histogram->ToProto(entry->mutable_seconds());
    if (entry->seconds().count() == 0) proto->RemoveLast();  // made, not yet recorded
  }
}

}  // namespace flatshard::server
