// Element types flatshard stores, moves and exports.
//
// float32, bfloat16 and float16 can be the dtype of a tensor in a flat parameter (the
// server keeps an fp32 master copy; gather and scatter may use any of the three).
// float64 and the integer types are carried only so that checkpoints and exports can
// describe them. Thread-safe: everything here is pure.
//
//   FLATSHARD_ASSIGN_OR_RETURN(DType dtype, ParseDType("bfloat16"));
//   size_t bytes = numel * DTypeSize(dtype);
#ifndef FLATSHARD_CORE_DTYPE_H_
#define FLATSHARD_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace flatshard {

enum class DType : uint8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat64,
  kInt64,
  kInt32,
  kInt16,
  kInt8,
  kUInt8,
  kBool,
};

// PyTorch's name without the "torch." prefix: "float32", "bfloat16", ...
absl::string_view DTypeName(DType dtype);

// The safetensors header name: "F32", "BF16", "F16", "F64", "I64", ..., "BOOL".
absl::string_view SafetensorsDTypeName(DType dtype);

// Accepts PyTorch names ("float32", also with a "torch." prefix, and the aliases
// "float", "half", "double", "long", "int") and safetensors names ("F32", ...).
// Returns InvalidArgument naming the text and the accepted names otherwise.
[[nodiscard]] absl::StatusOr<DType> ParseDType(absl::string_view name);

// Bytes per element.
size_t DTypeSize(DType dtype);

// True for the dtypes a flat parameter, a gather or a scatter may use.
bool IsFloatingParamDType(DType dtype);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_DTYPE_H_
