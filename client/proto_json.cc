#include "client/proto_json.h"

#include <charconv>
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace flatshard {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Reflection;

// A double as JSON, appended to `out`: its shortest decimal form that reads back to it,
// or the string proto3 uses for a value JSON has no number for. A float likewise, from
// its own shortest form: 0.1f is 0.1, not 0.100000001490116.
template <typename T>
void AppendFloating(T value, std::string& out) {
  if (std::isnan(value)) {
    out += "\"NaN\"";
  } else if (std::isinf(value)) {
    out += value > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  } else {
    char text[32];
    const std::to_chars_result written = std::to_chars(text, text + sizeof(text), value);
    out.append(text, written.ptr);
  }
}

}  // namespace

void JsonWriter::Raw(absl::string_view text) { out_.append(text.data(), text.size()); }

void JsonWriter::BeforeValue() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (filled_.empty()) return;  // the text's one value
  if (filled_.back()) out_ += ',';
  filled_.back() = true;
  if (indent_ >= 0) {
    out_ += '\n';
    out_.append(filled_.size() * static_cast<size_t>(indent_), ' ');
  }
}

void JsonWriter::Open(char bracket) {
  BeforeValue();
  out_ += bracket;
  filled_.push_back(false);
}

void JsonWriter::Close(char bracket) {
  const bool filled = filled_.back();
  filled_.pop_back();
  if (filled && indent_ >= 0) {
    out_ += '\n';
    out_.append(filled_.size() * static_cast<size_t>(indent_), ' ');
  }
  out_ += bracket;
}

void JsonWriter::BeginObject() { Open('{'); }
void JsonWriter::EndObject() { Close('}'); }
void JsonWriter::BeginArray() { Open('['); }
void JsonWriter::EndArray() { Close(']'); }

void JsonWriter::Key(absl::string_view name) {
  String(name);
  Raw(indent_ >= 0 ? ": " : ":");
  after_key_ = true;
}

void JsonWriter::String(absl::string_view text) {
  BeforeValue();
  Quoted(text);
}

void JsonWriter::Quoted(absl::string_view text) {
  // nlohmann's escaping, with bytes that are not UTF-8 replaced rather than thrown over.
  Raw(nlohmann::json(std::string(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

void JsonWriter::Message(const google::protobuf::Message& message) {
  BeginObject();
  const google::protobuf::Descriptor& descriptor = *message.GetDescriptor();
  for (int i = 0; i < descriptor.field_count(); ++i) Field(message, *descriptor.field(i));
  EndObject();
}

void JsonWriter::Field(const google::protobuf::Message& message, const FieldDescriptor& field) {
  const Reflection& reflection = *message.GetReflection();
  if (field.is_map()) {
    Key(field.name());
    BeginObject();
    const FieldDescriptor& key = *field.message_type()->map_key();
    const FieldDescriptor& value = *field.message_type()->map_value();
    for (int j = 0; j < reflection.FieldSize(message, &field); ++j) {
      const google::protobuf::Message& entry = reflection.GetRepeatedMessage(message, &field, j);
      const Reflection& r = *entry.GetReflection();
      std::string scratch;
      switch (key.cpp_type()) {  // keys are integers, bools or strings; JSON's are strings
        case FieldDescriptor::CPPTYPE_STRING: Key(r.GetStringReference(entry, &key, &scratch)); break;
        case FieldDescriptor::CPPTYPE_BOOL: Key(r.GetBool(entry, &key) ? "true" : "false"); break;
        case FieldDescriptor::CPPTYPE_INT32: Key(absl::StrCat(r.GetInt32(entry, &key))); break;
        case FieldDescriptor::CPPTYPE_UINT32: Key(absl::StrCat(r.GetUInt32(entry, &key))); break;
        case FieldDescriptor::CPPTYPE_INT64: Key(absl::StrCat(r.GetInt64(entry, &key))); break;
        case FieldDescriptor::CPPTYPE_UINT64: Key(absl::StrCat(r.GetUInt64(entry, &key))); break;
        default: Key(""); break;  // no other type can be a map key
      }
      Value(entry, value, -1);
    }
    EndObject();
  } else if (field.is_repeated()) {
    Key(field.name());
    BeginArray();
    for (int j = 0; j < reflection.FieldSize(message, &field); ++j) Value(message, field, j);
    EndArray();
  } else if (reflection.HasField(message, &field) || !field.has_presence()) {
    Key(field.name());
    Value(message, field, -1);
  }
}

// One value of `field`: its only one, or the `index`th of a repeated field (index >= 0).
// Numbers go straight into the text: a status has millions of them.
void JsonWriter::Value(const google::protobuf::Message& message, const FieldDescriptor& field, int index) {
  const Reflection& r = *message.GetReflection();
  const bool repeated = index >= 0;
  if (field.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    return Message(repeated ? r.GetRepeatedMessage(message, &field, index) : r.GetMessage(message, &field));
  }
  BeforeValue();
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrAppend(&out_,
                             repeated ? r.GetRepeatedInt32(message, &field, index) : r.GetInt32(message, &field));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrAppend(&out_,
                             repeated ? r.GetRepeatedUInt32(message, &field, index) : r.GetUInt32(message, &field));
    case FieldDescriptor::CPPTYPE_INT64:  // as strings: a double (JavaScript's number) holds 53 bits
      return absl::StrAppend(
          &out_, "\"", repeated ? r.GetRepeatedInt64(message, &field, index) : r.GetInt64(message, &field), "\"");
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrAppend(
          &out_, "\"", repeated ? r.GetRepeatedUInt64(message, &field, index) : r.GetUInt64(message, &field), "\"");
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return AppendFloating(repeated ? r.GetRepeatedDouble(message, &field, index) : r.GetDouble(message, &field),
                            out_);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return AppendFloating(repeated ? r.GetRepeatedFloat(message, &field, index) : r.GetFloat(message, &field),
                            out_);
    case FieldDescriptor::CPPTYPE_BOOL:
      return Raw((repeated ? r.GetRepeatedBool(message, &field, index) : r.GetBool(message, &field)) ? "true"
                                                                                                   : "false");
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int value = repeated ? r.GetRepeatedEnumValue(message, &field, index) : r.GetEnumValue(message, &field);
      const google::protobuf::EnumValueDescriptor* named = field.enum_type()->FindValueByNumber(value);
      if (named == nullptr) return absl::StrAppend(&out_, value);  // a value this build does not know
      return Quoted(named->name());
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string scratch;
      const std::string& text = repeated ? r.GetRepeatedStringReference(message, &field, index, &scratch)
                                         : r.GetStringReference(message, &field, &scratch);
      return Quoted(field.type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(text) : text);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;  // above
  }
}

}  // namespace flatshard
