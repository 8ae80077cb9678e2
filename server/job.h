// The settings of a training job (DESIGN.md, "The training step"): how many workers
// contribute to each step, how contributions are reduced, gradient clipping, and the
// asynchronous (parameter-server) mode. Plain values.
#ifndef FLATSHARD_SERVER_JOB_H_
#define FLATSHARD_SERVER_JOB_H_

#include <cstdint>

namespace flatshard::server {

struct JobSettings {
  int num_workers = 1;       // W
  bool reduce_mean = true;   // false: sum
  double max_grad_norm = 0;  // 0: no clipping (sync mode only)
  double norm_type = 2.0;    // 2 or +inf
  bool async = false;        // apply each contribution on arrival
  int64_t max_staleness = -1;  // async: refuse contributions older than this; < 0: no bound

  bool clipping() const { return max_grad_norm > 0; }
  friend bool operator==(const JobSettings&, const JobSettings&) = default;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_JOB_H_
