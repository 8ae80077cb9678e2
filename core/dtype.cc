#include "core/dtype.h"

#include <array>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  absl::string_view safetensors_name;
  size_t size;
};

constexpr std::array<DTypeInfo, 10> kDTypes = {{
    {DType::kFloat32, "float32", "F32", 4},
    {DType::kBFloat16, "bfloat16", "BF16", 2},
    {DType::kFloat16, "float16", "F16", 2},
    {DType::kFloat64, "float64", "F64", 8},
    {DType::kInt64, "int64", "I64", 8},
    {DType::kInt32, "int32", "I32", 4},
    {DType::kInt16, "int16", "I16", 2},
    {DType::kInt8, "int8", "I8", 1},
    {DType::kUInt8, "uint8", "U8", 1},
    {DType::kBool, "bool", "BOOL", 1},
}};

struct Alias {
  absl::string_view name;
  DType dtype;
};
constexpr std::array<Alias, 5> kAliases = {{
    {"float", DType::kFloat32},
    {"half", DType::kFloat16},
    {"double", DType::kFloat64},
    {"long", DType::kInt64},
    {"int", DType::kInt32},
}};

const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

absl::string_view SafetensorsDTypeName(DType dtype) { return Info(dtype).safetensors_name; }

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

bool IsFloatingParamDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  absl::string_view bare = name;
  if (bare.substr(0, 6) == "torch.") bare.remove_prefix(6);
  for (const DTypeInfo& info : kDTypes) {
    if (bare == info.name || name == info.safetensors_name) return info.dtype;
  }
  for (const Alias& alias : kAliases) {
    if (bare == alias.name) return alias.dtype;
  }
  std::vector<absl::string_view> names;
  for (const DTypeInfo& info : kDTypes) names.push_back(info.name);
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "' (expected one of ",
                                                 absl::StrJoin(names, ", "), ")"));
}

}  // namespace flatshard
