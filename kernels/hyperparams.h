// Optimizer hyper-parameters shared by the CPU and CUDA optimizer kernels (torch.optim's
// names and defaults). Plain value types.
//
//   AdamHyperparams adamw{.lr = 1e-3f, .weight_decay = 0.01f, .decoupled_weight_decay = true};
#ifndef FLATSHARD_KERNELS_HYPERPARAMS_H_
#define FLATSHARD_KERNELS_HYPERPARAMS_H_

namespace flatshard::kernels {

struct SgdHyperparams {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

struct AdamHyperparams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool amsgrad = false;
  bool decoupled_weight_decay = false;  // true: AdamW
};

}  // namespace flatshard::kernels

#endif  // FLATSHARD_KERNELS_HYPERPARAMS_H_
