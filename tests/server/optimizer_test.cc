// ShardOptimizer's bookkeeping on the host tier: which state it keeps for which
// settings, how settings change between steps, state reads, restore and reset. The
// update math itself is tested in tests/kernels/optimizer_test.cc; here a float64
// reference checks that the step count and the state reach the kernels.
#include "server/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

namespace flatshard::server {
namespace {

using kernels::AdamHyperparams;
using kernels::SgdHyperparams;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kNumel = 1000;

class ShardOptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto compute = MakeShardCompute(MemoryTier::kHost);
    ASSERT_TRUE(compute.ok()) << compute.status();
    compute_ = *std::move(compute);
  }

  ShardOptimizer Make(OptimizerConfig config) {
    auto optimizer = ShardOptimizer::Create(std::move(config), kNumel, *compute_, "group 'g'");
    EXPECT_TRUE(optimizer.ok()) << optimizer.status();
    return *std::move(optimizer);
  }

  // kNumel floats of shard memory, uniform in [lo, hi).
  ShardBuffer Filled(float lo, float hi, uint32_t seed) {
    auto buffer = compute_->AllocateShard(kNumel * sizeof(float), "test");
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (int64_t i = 0; i < kNumel; ++i) buffer->floats()[i] = dist(rng);
    return *std::move(buffer);
  }

  std::unique_ptr<ShardCompute> compute_;
};

TEST(OptimizerSettingsTest, ValidationNamesTheOffendingField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::pair<OptimizerConfig, const char*> bad[] = {
      {SgdHyperparams{.lr = -0.1f}, "sgd.lr"},
      {SgdHyperparams{.lr = nan}, "sgd.lr"},
      {SgdHyperparams{.momentum = -0.5f}, "sgd.momentum"},
      {SgdHyperparams{.weight_decay = -1e-4f}, "sgd.weight_decay"},
      {SgdHyperparams{.nesterov = true}, "sgd.nesterov"},
      {SgdHyperparams{.momentum = 0.9f, .dampening = 0.1f, .nesterov = true}, "sgd.nesterov"},
      {AdamHyperparams{.lr = -1e-3f}, "adam.lr"},
      {AdamHyperparams{.beta1 = 1.0f}, "adam.beta1"},
      {AdamHyperparams{.beta2 = -0.1f}, "adam.beta2"},
      {AdamHyperparams{.eps = 0.0f}, "adam.eps"},
      {AdamHyperparams{.weight_decay = nan}, "adam.weight_decay"},
  };
  for (const auto& [config, field] : bad) {
    const absl::Status status = ValidateOptimizer(config);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << field << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(field));
  }
  EXPECT_TRUE(ValidateOptimizer(SgdHyperparams{.momentum = 0.9f, .nesterov = true}).ok());
  EXPECT_TRUE(ValidateOptimizer(AdamHyperparams{}).ok());
  EXPECT_TRUE(ValidateOptimizer(AdamHyperparams{.beta1 = 0.0f}).ok());
}

TEST(OptimizerSettingsTest, NamesAndJsonUseTorchsSpellingAndShortestFloats) {
  EXPECT_EQ(OptimizerName(SgdHyperparams{}), "sgd");
  EXPECT_EQ(OptimizerName(AdamHyperparams{}), "adam");
  EXPECT_EQ(OptimizerName(AdamHyperparams{.decoupled_weight_decay = true}), "adamw");
  EXPECT_EQ(OptimizerHyperparamsJson(AdamHyperparams{.weight_decay = 0.01f, .amsgrad = true}),
            R"({"lr":0.001,"betas":[0.9,0.999],"eps":1e-08,"weight_decay":0.01,"amsgrad":true})");
  EXPECT_EQ(OptimizerHyperparamsJson(SgdHyperparams{.lr = 0.1f, .momentum = 0.9f, .nesterov = true}),
            R"({"lr":0.1,"momentum":0.9,"dampening":0,"weight_decay":0,"nesterov":true})");
  EXPECT_TRUE(SameOptimizer(AdamHyperparams{}, AdamHyperparams{}));
  EXPECT_FALSE(SameOptimizer(AdamHyperparams{}, AdamHyperparams{.decoupled_weight_decay = true}));
  EXPECT_FALSE(SameOptimizer(SgdHyperparams{}, AdamHyperparams{}));
  EXPECT_EQ(OptimizerName(Frozen{}), "frozen");
  EXPECT_EQ(OptimizerHyperparamsJson(Frozen{}), "{}");
  EXPECT_TRUE(ValidateOptimizer(Frozen{}).ok());
  EXPECT_TRUE(SameOptimizer(Frozen{}, Frozen{}));
  EXPECT_FALSE(SameOptimizer(Frozen{}, SgdHyperparams{}));
  EXPECT_EQ(OptimizerName(Average{}), "average");
  EXPECT_EQ(OptimizerHyperparamsJson(Average{}), "{}");
  EXPECT_TRUE(ValidateOptimizer(Average{}).ok());
  EXPECT_TRUE(SameOptimizer(Average{}, Average{}));
  EXPECT_FALSE(SameOptimizer(Average{}, Frozen{}));
}

TEST_F(ShardOptimizerTest, KeepsExactlyTheStateItsSettingsNeed) {
  const size_t buffer = kNumel * sizeof(float);
  struct Case {
    OptimizerConfig config;
    std::vector<std::string> names;
  };
  const Case cases[] = {
      {SgdHyperparams{}, {}},
      {SgdHyperparams{.momentum = 0.9f}, {"momentum_buffer"}},
      {AdamHyperparams{}, {"exp_avg", "exp_avg_sq"}},
      {AdamHyperparams{.amsgrad = true}, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {Frozen{}, {}},
      {Average{}, {}},
  };
  for (const Case& c : cases) {
    ShardOptimizer optimizer = Make(c.config);
    EXPECT_EQ(optimizer.state_names(), c.names) << OptimizerName(c.config);
    EXPECT_EQ(optimizer.state_bytes(), static_cast<int64_t>(c.names.size() * buffer));
    for (const std::string& name : c.names) {
      auto state = optimizer.ReadState(name);
      ASSERT_TRUE(state.ok()) << state.status();
      EXPECT_EQ(std::count(state->begin(), state->end(), 0.0f), kNumel) << name << " starts zeroed";
    }
  }
}

TEST_F(ShardOptimizerTest, SwitchingBetweenSgdAndAdamIsRefusedAndChangesNothing) {
  ShardOptimizer optimizer = Make(SgdHyperparams{.lr = 0.5f});
  const absl::Status status = optimizer.SetConfig(AdamHyperparams{});
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("optimizer is sgd; cannot switch to adam"));
  EXPECT_TRUE(SameOptimizer(optimizer.config(), SgdHyperparams{.lr = 0.5f}));
}

TEST_F(ShardOptimizerTest, AFrozenOptimizerTakesNoStepAndStaysFrozen) {
  ShardOptimizer optimizer = Make(Frozen{});
  std::vector<float> params(kNumel, 1.0f), grad(kNumel, 1.0f);
  const absl::Status step = optimizer.Step(params.data(), grad.data());
  EXPECT_TRUE(absl::IsFailedPrecondition(step)) << step;
  EXPECT_THAT(std::string(step.message()), HasSubstr("frozen"));
  EXPECT_EQ(optimizer.steps(), 0);
  EXPECT_EQ(params, std::vector<float>(kNumel, 1.0f));
  EXPECT_THAT(std::string(optimizer.SetConfig(AdamHyperparams{}).message()),
              HasSubstr("optimizer is frozen; cannot switch to adam"));
  EXPECT_TRUE(optimizer.SetConfig(Frozen{}).ok());
  EXPECT_THAT(std::string(Make(SgdHyperparams{}).SetConfig(Frozen{}).message()),
              HasSubstr("optimizer is sgd; cannot switch to frozen"));
}

TEST_F(ShardOptimizerTest, AnAverageStepTakesTheReducedValuesAsTheyAre) {
  ShardOptimizer optimizer = Make(Average{});
  ShardBuffer params = Filled(-1, 1, 1), values = Filled(-1e20f, 1e20f, 2);
  ASSERT_TRUE(optimizer.Step(params.floats(), values.floats()).ok());
  EXPECT_EQ(std::memcmp(params.data(), values.data(), values.size()), 0);
  EXPECT_EQ(optimizer.steps(), 1);
  EXPECT_THAT(std::string(optimizer.SetConfig(SgdHyperparams{}).message()),
              HasSubstr("optimizer is average; cannot switch to sgd"));
}

// torch.optim.SGD creates the momentum buffer on the first step that uses momentum, as
// a copy of the gradient: turning momentum on mid-training must behave the same.
TEST_F(ShardOptimizerTest, MomentumTurnedOnLaterStartsFromTheGradient) {
  ShardOptimizer optimizer = Make(SgdHyperparams{.lr = 0.1f});
  ShardBuffer params = Filled(-1, 1, 1), grad = Filled(-1, 1, 2);
  ASSERT_TRUE(optimizer.Step(params.floats(), grad.floats()).ok());
  EXPECT_THAT(optimizer.state_names(), ElementsAre());
  ASSERT_TRUE(optimizer.SetConfig(SgdHyperparams{.lr = 0.1f, .momentum = 0.9f}).ok());
  EXPECT_THAT(optimizer.state_names(), ElementsAre("momentum_buffer"));

  std::vector<double> expected(params.floats(), params.floats() + kNumel);
  ShardBuffer grad2 = Filled(-1, 1, 3);
  for (int64_t i = 0; i < kNumel; ++i) expected[i] -= 0.1 * grad2.floats()[i];  // buf = g
  ASSERT_TRUE(optimizer.Step(params.floats(), grad2.floats()).ok());
  auto momentum = optimizer.ReadState("momentum_buffer");
  ASSERT_TRUE(momentum.ok()) << momentum.status();
  for (int64_t i = 0; i < kNumel; ++i) {
    ASSERT_EQ((*momentum)[i], grad2.floats()[i]) << i;
    ASSERT_NEAR(params.floats()[i], expected[i], 1e-6) << i;
  }
  EXPECT_EQ(optimizer.steps(), 2);
}

// After a restore at step 10 the next update uses t = 11 in Adam's bias corrections
// (at t = 1 the second-moment correction alone differs tenfold).
TEST_F(ShardOptimizerTest, RestoredStepsAndStateDriveTheNextUpdate) {
  const AdamHyperparams adam{.lr = 1e-2f, .weight_decay = 0.1f, .decoupled_weight_decay = true};
  ShardOptimizer optimizer = Make(adam);
  ShardBuffer m = Filled(-0.1f, 0.1f, 4), v = Filled(0.0f, 0.01f, 5);
  const std::vector<float> m0(m.floats(), m.floats() + kNumel), v0(v.floats(), v.floats() + kNumel);
  std::vector<std::pair<std::string, ShardBuffer>> state;
  state.emplace_back("exp_avg", std::move(m));
  state.emplace_back("exp_avg_sq", std::move(v));
  ASSERT_TRUE(optimizer.Restore(10, false, std::move(state)).ok());
  EXPECT_EQ(optimizer.steps(), 10);

  ShardBuffer params = Filled(-1, 1, 6), grad = Filled(-1, 1, 7);
  const std::vector<float> p0(params.floats(), params.floats() + kNumel);
  ASSERT_TRUE(optimizer.Step(params.floats(), grad.floats()).ok());
  EXPECT_EQ(optimizer.steps(), 11);
  const double t = 11, b1 = adam.beta1, b2 = adam.beta2;
  for (int64_t i = 0; i < kNumel; ++i) {
    const double g = grad.floats()[i];
    const double m1 = b1 * m0[i] + (1 - b1) * g;
    const double v1 = b2 * v0[i] + (1 - b2) * g * g;
    const double p = p0[i] * (1 - double{adam.lr} * adam.weight_decay);
    const double denom = std::sqrt(v1) / std::sqrt(1 - std::pow(b2, t)) + adam.eps;
    const double want = p - adam.lr / (1 - std::pow(b1, t)) * m1 / denom;
    ASSERT_NEAR(params.floats()[i], want, 1e-5 * std::max(1.0, std::abs(want))) << i;
  }
}

TEST_F(ShardOptimizerTest, RestoreRefusesMissingOrMisshapenStateAndChangesNothing) {
  ShardOptimizer optimizer = Make(AdamHyperparams{});
  std::vector<std::pair<std::string, ShardBuffer>> missing;
  missing.emplace_back("exp_avg", Filled(0, 1, 8));
  absl::Status status = optimizer.Restore(5, false, std::move(missing));
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("'exp_avg_sq'"));

  std::vector<std::pair<std::string, ShardBuffer>> short_state;
  short_state.emplace_back("exp_avg", Filled(0, 1, 9));
  auto small = compute_->AllocateShard(16, "small");
  ASSERT_TRUE(small.ok());
  short_state.emplace_back("exp_avg_sq", *std::move(small));
  status = optimizer.Restore(5, false, std::move(short_state));
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_EQ(optimizer.steps(), 0);
  auto exp_avg = optimizer.ReadState("exp_avg");
  ASSERT_TRUE(exp_avg.ok());
  EXPECT_EQ(std::count(exp_avg->begin(), exp_avg->end(), 0.0f), kNumel);
}

TEST_F(ShardOptimizerTest, StateReadsAreCheckedByNameAndRange) {
  ShardOptimizer optimizer = Make(SgdHyperparams{.momentum = 0.9f});
  EXPECT_TRUE(absl::IsInvalidArgument(optimizer.ReadState("exp_avg").status()));
  std::vector<float> out(kNumel);
  EXPECT_TRUE(optimizer.ReadStateSlice("momentum_buffer", kNumel - 10, 10, out.data()).ok());
  for (auto [offset, count] : std::vector<std::pair<int64_t, int64_t>>{
           {-1, 1}, {0, -1}, {kNumel - 10, 11}, {std::numeric_limits<int64_t>::max(), 1}}) {
    const absl::Status status = optimizer.ReadStateSlice("momentum_buffer", offset, count, out.data());
    EXPECT_TRUE(absl::IsOutOfRange(status)) << offset << "+" << count << ": " << status;
  }
}

// Whatever wrote the state (a step, a restore of a checkpoint at step 0), Reset leaves
// zeros, also when called twice.
TEST_F(ShardOptimizerTest, ResetForgetsStepsAndState) {
  ShardOptimizer optimizer = Make(AdamHyperparams{.amsgrad = true});
  auto expect_zero = [&](const std::string& after) {
    EXPECT_EQ(optimizer.steps(), 0) << after;
    for (const std::string& name : optimizer.state_names()) {
      auto state = optimizer.ReadState(name);
      ASSERT_TRUE(state.ok());
      EXPECT_EQ(std::count(state->begin(), state->end(), 0.0f), kNumel) << name << " after " << after;
    }
  };
  ShardBuffer params = Filled(-1, 1, 10), grad = Filled(-1, 1, 11);
  ASSERT_TRUE(optimizer.Step(params.floats(), grad.floats()).ok());
  ASSERT_TRUE(optimizer.Reset().ok());
  expect_zero("a step");
  ASSERT_TRUE(optimizer.Reset().ok());
  expect_zero("a second reset");

  std::vector<std::pair<std::string, ShardBuffer>> state;
  state.emplace_back("exp_avg", Filled(-1, 1, 12));
  state.emplace_back("exp_avg_sq", Filled(0.5f, 1, 13));
  state.emplace_back("max_exp_avg_sq", Filled(0.5f, 1, 14));
  ASSERT_TRUE(optimizer.Restore(0, false, std::move(state)).ok());  // a checkpoint of step 0
  ASSERT_TRUE(optimizer.Reset().ok());
  expect_zero("a restore");
}

}  // namespace
}  // namespace flatshard::server
