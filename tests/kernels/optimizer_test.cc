// The fused optimizer kernels against a float64 reference written from torch.optim's
// documented update rules, over 25 steps with fresh random gradients each step.
#include "kernels/cpu/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace flatshard::kernels::cpu {
namespace {

constexpr int kSteps = 25;
constexpr size_t kNumel = 1037;

struct Reference {
  std::vector<double> p, m, v, v_max, buf;
};

std::vector<float> RandomNormal(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& x : values) x = normal(rng);
  return values;
}

void ExpectClose(const std::vector<float>& ours, const std::vector<double>& reference,
                 const char* what) {
  for (size_t i = 0; i < ours.size(); ++i) {
    ASSERT_NEAR(ours[i], reference[i], 2e-6 + 2e-5 * std::fabs(reference[i])) << what << " " << i;
  }
}

void RunAdam(const AdamHyperparams& hp) {
  std::mt19937 rng(11);
  std::vector<float> p = RandomNormal(rng, kNumel, 1.0f);
  std::vector<float> m(kNumel), v(kNumel), v_max(kNumel);
  Reference ref{{p.begin(), p.end()}, std::vector<double>(kNumel), std::vector<double>(kNumel),
                std::vector<double>(kNumel), {}};
  for (int step = 1; step <= kSteps; ++step) {
    const std::vector<float> g = RandomNormal(rng, kNumel, 0.1f);
    AdamStep(hp, step, absl::MakeSpan(p), g, absl::MakeSpan(m), absl::MakeSpan(v),
             absl::MakeSpan(v_max));
    const double bc1 = 1.0 - std::pow(double{hp.beta1}, step);
    const double bc2 = 1.0 - std::pow(double{hp.beta2}, step);
    for (size_t i = 0; i < kNumel; ++i) {
      double grad = g[i];
      double& param = ref.p[i];
      if (hp.decoupled_weight_decay) {
        param *= 1.0 - double{hp.lr} * hp.weight_decay;
      } else {
        grad += double{hp.weight_decay} * param;
      }
      ref.m[i] = hp.beta1 * ref.m[i] + (1.0 - hp.beta1) * grad;
      ref.v[i] = hp.beta2 * ref.v[i] + (1.0 - hp.beta2) * grad * grad;
      ref.v_max[i] = std::max(ref.v_max[i], ref.v[i]);
      const double second = hp.amsgrad ? ref.v_max[i] : ref.v[i];
      const double denom = std::sqrt(second) / std::sqrt(bc2) + hp.eps;
      param -= hp.lr / bc1 * ref.m[i] / denom;
    }
  }
  ExpectClose(p, ref.p, "param");
  ExpectClose(m, ref.m, "exp_avg");
  ExpectClose(v, ref.v, "exp_avg_sq");
}

TEST(OptimizerKernelTest, Adam) { RunAdam({.lr = 1e-2f, .weight_decay = 0.0f}); }
TEST(OptimizerKernelTest, AdamWithL2) { RunAdam({.lr = 1e-2f, .weight_decay = 0.1f}); }
TEST(OptimizerKernelTest, AdamAmsgrad) {
  RunAdam({.lr = 1e-2f, .beta1 = 0.8f, .beta2 = 0.99f, .weight_decay = 0.01f, .amsgrad = true});
}
TEST(OptimizerKernelTest, AdamW) {
  RunAdam({.lr = 1e-2f, .eps = 1e-6f, .weight_decay = 0.05f, .decoupled_weight_decay = true});
}

void RunSgd(const SgdHyperparams& hp) {
  std::mt19937 rng(5);
  std::vector<float> p = RandomNormal(rng, kNumel, 1.0f);
  std::vector<float> buf(kNumel, 123.0f);  // poisoned: the first step must overwrite it
  Reference ref{{p.begin(), p.end()}, {}, {}, {}, std::vector<double>(kNumel)};
  for (int step = 1; step <= kSteps; ++step) {
    const std::vector<float> g = RandomNormal(rng, kNumel, 0.1f);
    SgdStep(hp, step == 1, absl::MakeSpan(p), g, absl::MakeSpan(buf));
    for (size_t i = 0; i < kNumel; ++i) {
      double d_p = g[i] + double{hp.weight_decay} * ref.p[i];
      if (hp.momentum != 0.0f) {
        ref.buf[i] = step == 1 ? d_p : hp.momentum * ref.buf[i] + (1.0 - hp.dampening) * d_p;
        d_p = hp.nesterov ? d_p + hp.momentum * ref.buf[i] : ref.buf[i];
      }
      ref.p[i] -= hp.lr * d_p;
    }
  }
  ExpectClose(p, ref.p, "param");
  if (hp.momentum != 0.0f) ExpectClose(buf, ref.buf, "momentum_buffer");
}

TEST(OptimizerKernelTest, PlainSgd) { RunSgd({.lr = 0.1f}); }
TEST(OptimizerKernelTest, SgdMomentumDampeningDecay) {
  RunSgd({.lr = 0.05f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 0.01f});
}
TEST(OptimizerKernelTest, SgdNesterov) {
  RunSgd({.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.001f, .nesterov = true});
}

TEST(OptimizerKernelTest, PaddingStaysZero) {
  std::vector<float> p(64, 0.0f), g(64, 0.0f), m(64), v(64), v_max(64), buf(64);
  for (int step = 1; step <= 3; ++step) {
    AdamStep({.weight_decay = 0.1f, .decoupled_weight_decay = true}, step, absl::MakeSpan(p), g,
             absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(v_max));
    SgdStep({.momentum = 0.9f, .weight_decay = 0.1f, .nesterov = true}, step == 1,
            absl::MakeSpan(p), g, absl::MakeSpan(buf));
  }
  EXPECT_EQ(p, std::vector<float>(64, 0.0f));
}

}  // namespace
}  // namespace flatshard::kernels::cpu
