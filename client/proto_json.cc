#include "client/proto_json.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace flatshard {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

nlohmann::json FloatingToJson(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

// A float as the double its shortest decimal form reads as: 0.1f is 0.1, not
// 0.100000001490116, as protobuf prints it.
double ShortestDouble(float value) {
  char text[32];
  const std::to_chars_result written = std::to_chars(text, text + sizeof(text) - 1, value);
  *written.ptr = '\0';
  return std::strtod(text, nullptr);
}

nlohmann::json EnumToJson(const FieldDescriptor& field, int number) {
  const google::protobuf::EnumValueDescriptor* value = field.enum_type()->FindValueByNumber(number);
  if (value == nullptr) return number;  // a value this build does not know
  return value->name();
}

// One value of `field`: its only one, or the `index`th of a repeated field (index >= 0).
nlohmann::json ValueToJson(const Message& message, const FieldDescriptor& field, int index) {
  const Reflection& r = *message.GetReflection();
  const bool repeated = index >= 0;
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return repeated ? r.GetRepeatedInt32(message, &field, index) : r.GetInt32(message, &field);
    case FieldDescriptor::CPPTYPE_UINT32:
      return repeated ? r.GetRepeatedUInt32(message, &field, index) : r.GetUInt32(message, &field);
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(repeated ? r.GetRepeatedInt64(message, &field, index) : r.GetInt64(message, &field));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(repeated ? r.GetRepeatedUInt64(message, &field, index) : r.GetUInt64(message, &field));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return FloatingToJson(repeated ? r.GetRepeatedDouble(message, &field, index) : r.GetDouble(message, &field));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return FloatingToJson(
          ShortestDouble(repeated ? r.GetRepeatedFloat(message, &field, index) : r.GetFloat(message, &field)));
    case FieldDescriptor::CPPTYPE_BOOL:
      return repeated ? r.GetRepeatedBool(message, &field, index) : r.GetBool(message, &field);
    case FieldDescriptor::CPPTYPE_ENUM:
      return EnumToJson(field, repeated ? r.GetRepeatedEnumValue(message, &field, index)
                                        : r.GetEnumValue(message, &field));
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string scratch;
      const std::string& text = repeated ? r.GetRepeatedStringReference(message, &field, index, &scratch)
                                         : r.GetStringReference(message, &field, &scratch);
      return field.type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(text) : text;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(repeated ? r.GetRepeatedMessage(message, &field, index) : r.GetMessage(message, &field));
  }
  return nullptr;
}

// A map entry's key as the JSON object key: its text (bools as "true"/"false").
std::string MapKey(const Message& entry) {
  const FieldDescriptor& key = *entry.GetDescriptor()->map_key();
  const nlohmann::json value = ValueToJson(entry, key, -1);
  return value.is_string() ? value.get<std::string>() : value.dump();
}

}  // namespace

nlohmann::json ProtoToJson(const Message& message) {
  const google::protobuf::Descriptor& descriptor = *message.GetDescriptor();
  const Reflection& reflection = *message.GetReflection();
  nlohmann::json out = nlohmann::json::object();
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const FieldDescriptor& field = *descriptor.field(i);
    if (field.is_map()) {
      nlohmann::json& map = out[field.name()] = nlohmann::json::object();
      const FieldDescriptor& value = *field.message_type()->map_value();
      for (int j = 0; j < reflection.FieldSize(message, &field); ++j) {
        const Message& entry = reflection.GetRepeatedMessage(message, &field, j);
        map[MapKey(entry)] = ValueToJson(entry, value, -1);
      }
    } else if (field.is_repeated()) {
      nlohmann::json& list = out[field.name()] = nlohmann::json::array();
      const int size = reflection.FieldSize(message, &field);
      list.get_ref<nlohmann::json::array_t&>().reserve(size);
      for (int j = 0; j < size; ++j) list.push_back(ValueToJson(message, field, j));
    } else if (reflection.HasField(message, &field) || !field.has_presence()) {
      out[field.name()] = ValueToJson(message, field, -1);
    }
  }
  return out;
}

}  // namespace flatshard
