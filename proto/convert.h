// Conversions between flatshard's domain types (core/) and the control-plane protobufs,
// shared by the server and the client. Pure functions; thread-safe.
#ifndef FLATSHARD_PROTO_CONVERT_H_
#define FLATSHARD_PROTO_CONVERT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint_kind.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "proto/flatshard.pb.h"

namespace flatshard {

v1::DType ToProto(DType dtype);  // precondition: IsFloatingParamDType(dtype)
// InvalidArgument for DTYPE_UNSPECIFIED or an unknown value.
[[nodiscard]] absl::StatusOr<DType> FromProto(v1::DType dtype);

v1::CheckpointKind ToProto(CheckpointKind kind);
// InvalidArgument for CHECKPOINT_KIND_UNSPECIFIED or an unknown value.
[[nodiscard]] absl::StatusOr<CheckpointKind> FromProto(v1::CheckpointKind kind);

void ToProto(const std::vector<TensorSpec>& tensors,
             google::protobuf::RepeatedPtrField<v1::TensorSpec>* out);
[[nodiscard]] absl::StatusOr<std::vector<TensorSpec>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors);

}  // namespace flatshard

#endif  // FLATSHARD_PROTO_CONVERT_H_
