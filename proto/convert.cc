#include "proto/convert.h"

#include "absl/strings/str_cat.h"

namespace flatshard {

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return v1::BFLOAT16;
    case DType::kFloat16:
      return v1::FLOAT16;
    default:
      return v1::FLOAT32;
  }
}

absl::StatusOr<DType> FromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return DType::kFloat32;
    case v1::BFLOAT16:
      return DType::kBFloat16;
    case v1::FLOAT16:
      return DType::kFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", static_cast<int>(dtype), " is not float32, bfloat16 or float16"));
  }
}

v1::CheckpointKind ToProto(CheckpointKind kind) {
  switch (kind) {
    case CheckpointKind::kFull:
      return v1::FULL;
    case CheckpointKind::kSharded:
      return v1::SHARDED;
    case CheckpointKind::kLocal:
      return v1::LOCAL;
  }
  return v1::CHECKPOINT_KIND_UNSPECIFIED;
}

absl::StatusOr<CheckpointKind> FromProto(v1::CheckpointKind kind) {
  switch (kind) {
    case v1::FULL:
      return CheckpointKind::kFull;
    case v1::SHARDED:
      return CheckpointKind::kSharded;
    case v1::LOCAL:
      return CheckpointKind::kLocal;
    default:
      return absl::InvalidArgumentError(absl::StrCat("checkpoint kind ", static_cast<int>(kind),
                                                     ": expected FULL, SHARDED or LOCAL"));
  }
}

void ToProto(const std::vector<TensorSpec>& tensors,
             google::protobuf::RepeatedPtrField<v1::TensorSpec>* out) {
  for (const TensorSpec& spec : tensors) {
    v1::TensorSpec* proto = out->Add();
    proto->set_name(spec.fqn);
    for (int64_t dim : spec.shape) proto->add_shape(dim);
    proto->set_dtype(ToProto(spec.dtype));
  }
}

absl::StatusOr<std::vector<TensorSpec>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < tensors.size(); ++i) {
    absl::StatusOr<DType> dtype = FromProto(tensors[i].dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensors[", i, "] '", tensors[i].name(), "': ", dtype.status().message()));
    }
    specs.push_back(TensorSpec{tensors[i].name(),
                               {tensors[i].shape().begin(), tensors[i].shape().end()},
                               *dtype});
  }
  return specs;
}

}  // namespace flatshard
