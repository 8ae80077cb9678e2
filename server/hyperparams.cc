#include "server/hyperparams.h"

#include <memory>
#include <utility>
#include <vector>

#include "proto/flatshard.pb.h"

namespace flatshard::server {

absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::OptimizerSettings& proto) {
  switch (proto.kind_case()) {
    case v1::OptimizerSettings::kSgd: {
      const v1::SgdSettings& sgd = proto.sgd();
      return OptimizerConfig(kernels::SgdHyperparams{
          .lr = static_cast<float>(sgd.lr()),
          .momentum = static_cast<float>(sgd.momentum()),
          .dampening = static_cast<float>(sgd.dampening()),
          .weight_decay = static_cast<float>(sgd.weight_decay()),
          .nesterov = sgd.nesterov()});
    }
    case v1::OptimizerSettings::kAdam: {
      const v1::AdamSettings& adam = proto.adam();
      return OptimizerConfig(kernels::AdamHyperparams{
          .lr = static_cast<float>(adam.lr()),
          .beta1 = static_cast<float>(adam.beta1()),
          .beta2 = static_cast<float>(adam.beta2()),
          .eps = static_cast<float>(adam.eps()),
          .weight_decay = static_cast<float>(adam.weight_decay()),
          .amsgrad = adam.amsgrad(),
          .decoupled_weight_decay = adam.decoupled_weight_decay()});
    }
    case v1::OptimizerSettings::kFrozen:
      return OptimizerConfig(Frozen{});
    case v1::OptimizerSettings::kAverage:
      return OptimizerConfig(Average{});
    default:
      return absl::InvalidArgumentError("optimizer: none set (sgd, adam, frozen or average)");
  }
}

absl::Status SetHyperparams(Registry& registry, absl::string_view job, const v1::SetHyperparamsRequest& request) {
  if (request.groups().empty()) return absl::InvalidArgumentError("SetHyperparams names no group");
  // A refusal names its group (one call changes many).
  std::vector<std::pair<std::shared_ptr<Group>, OptimizerConfig>> changes;
  changes.reserve(request.groups_size());
  for (const v1::GroupOptimizer& entry : request.groups()) {
    absl::StatusOr<std::shared_ptr<Group>> group = registry.FindGroup(std::string(job), entry.group());
    if (!group.ok()) return group.status();
    absl::StatusOr<OptimizerConfig> optimizer = OptimizerFromProto(entry.optimizer());
    if (!optimizer.ok()) return NamingGroup(entry.group(), optimizer.status());
    if (absl::Status checked = (*group)->CheckOptimizer(*optimizer); !checked.ok()) {
      return NamingGroup(entry.group(), checked);
    }
    changes.emplace_back(*std::move(group), *std::move(optimizer));
  }
  for (size_t i = 0; i < changes.size(); ++i) {
    const auto& [group, optimizer] = changes[i];
    if (absl::Status set = group->SetOptimizer(optimizer); !set.ok()) {
      return NamingGroup(request.groups(static_cast<int>(i)).group(), set);
    }
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server
