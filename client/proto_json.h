// JsonWriter: JSON text written as it goes, compact or indented, with protobuf messages
// in it as protobuf's MessageToJsonString prints them with always_print_primitive_fields
// and preserve_proto_field_names (proto3's JSON mapping: fields in declaration order,
// 64-bit integers as strings, non-finite doubles as "NaN"/"Infinity"/"-Infinity", bytes
// as base64, enums by name, maps as objects, unset fields with their default values; set
// message fields only). Strings that are not UTF-8 get U+FFFD for the bad bytes.
//
// Why not the library's printer: protobuf 3.21's builds a tree of nodes per field and
// gives a string that had to be parsed again to join the servers' statuses, and a JSON
// tree of 40000 groups cost as much again to build, print and free. The status of 2
// servers of 20000 groups (33 MB of JSON) took 4.1 s to fetch and print that way, and
// 0.6 s this way, 0.2 s of it the fetch (cluster_bench's latency section times the
// printing alone). Well-known types (Timestamp, Any, wrappers) get no special form; the
// status messages use none. Not thread-safe; one writer per text.
//
//   JsonWriter json(/*indent=*/2);
//   json.BeginObject();
//   json.Key("servers");
//   json.BeginArray();
//   json.Message(status);
//   json.EndArray();
//   json.EndObject();
//   std::string text = json.Take();
#ifndef FLATSHARD_CLIENT_PROTO_JSON_H_
#define FLATSHARD_CLIENT_PROTO_JSON_H_

#include <google/protobuf/message.h>

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace flatshard {

class JsonWriter {
 public:
  // `indent` < 0: one line, no spaces; otherwise each member and element on a line of
  // its own, indented by `indent` spaces per level (as nlohmann's dump(indent)).
  explicit JsonWriter(int indent) : indent_(indent) {}

  // Structure: a value (BeginObject, BeginArray, String, Message) goes where a value is
  // due: first, after Key in an object, or as an array's element. Misuse is a bug.
  void BeginObject();
  void EndObject();
  void BeginArray();
  void EndArray();
  void Key(absl::string_view name);
  void String(absl::string_view text);
  void Message(const google::protobuf::Message& message);

  // The text written; the writer is empty afterwards.
  std::string Take() { return std::move(out_); }

 private:
  void Open(char bracket);
  void Close(char bracket);
  void BeforeValue();  // the separator and line break a value needs where it goes
  void Raw(absl::string_view text);
  void Quoted(absl::string_view text);  // `text` as a JSON string, with no separator before it
  void Field(const google::protobuf::Message& message, const google::protobuf::FieldDescriptor& field);
  void Value(const google::protobuf::Message& message, const google::protobuf::FieldDescriptor& field, int index);

  const int indent_;
  std::string out_;
  // Per open object or array: whether it has a member or element yet.
  std::vector<bool> filled_;
  bool after_key_ = false;
};

}  // namespace flatshard

#endif  // FLATSHARD_CLIENT_PROTO_JSON_H_
