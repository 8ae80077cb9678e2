// Optimizer settings from their protobufs, and a change of several groups' settings
// between steps (a learning-rate schedule), as the SetHyperparams RPC and the data
// plane's kSetHyperparams request (transport/data_protocol.h) both make it: one rule for
// both. Pure functions over the Registry; thread-safe as it and its Groups are.
//
//   FLATSHARD_RETURN_IF_ERROR(SetHyperparams(registry, "default", request));
#ifndef FLATSHARD_SERVER_HYPERPARAMS_H_
#define FLATSHARD_SERVER_HYPERPARAMS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/optimizer.h"
#include "server/registry.h"

namespace flatshard::v1 {
class OptimizerSettings;
class SetHyperparamsRequest;
}  // namespace flatshard::v1

namespace flatshard::server {

// Reads an OptimizerSettings proto; InvalidArgument when none is set.
[[nodiscard]] absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::OptimizerSettings& proto);

// The groups of `job` that `request` names take its settings (request.job() is not read:
// the caller says which job). Every group is found and its settings checked before any
// changes: NotFound, InvalidArgument (no optimizer, a setting out of range) or
// FailedPrecondition (another optimizer kind), naming the group, change nothing, as does
// InvalidArgument for no group. Only memory for state the new settings need (momentum,
// amsgrad) can still run out part-way (ResourceExhausted naming the group), leaving the
// groups before it changed.
[[nodiscard]] absl::Status SetHyperparams(Registry& registry, absl::string_view job,
                                          const v1::SetHyperparamsRequest& request);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_HYPERPARAMS_H_
