// The settings of a training job (DESIGN.md, "The training step"): how many workers
// contribute to each step and how contributions are reduced. Plain values.
#ifndef FLATSHARD_SERVER_JOB_H_
#define FLATSHARD_SERVER_JOB_H_

namespace flatshard::server {

struct JobSettings {
  int num_workers = 1;       // W
  bool reduce_mean = true;   // false: sum
  double max_grad_norm = 0;  // 0: no clipping
  double norm_type = 2.0;

  friend bool operator==(const JobSettings&, const JobSettings&) = default;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_JOB_H_
