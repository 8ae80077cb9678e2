// ProtoToJson: a protobuf message as the JSON that protobuf's MessageToJsonString prints
// with always_print_primitive_fields and preserve_proto_field_names (proto3's JSON mapping:
// 64-bit integers as strings, non-finite doubles as "NaN"/"Infinity"/"-Infinity", bytes
// as base64, enums by name, maps as objects, unset fields with their default values),
// built straight from reflection into an nlohmann::json.
//
// Why not the library's printer: protobuf 3.21's builds a tree of nodes per field and
// gives a string that had to be parsed again to join the servers' statuses. The status of
// 2 servers of 20000 groups (32 MB of JSON) took 4.1 s to fetch and print that way and
// 1.9 s this way. Well-known types (Timestamp, Any, wrappers) get no special form; the
// status messages use none. Pure function; thread-safe.
//
//   nlohmann::json json = ProtoToJson(status);
#ifndef FLATSHARD_CLIENT_PROTO_JSON_H_
#define FLATSHARD_CLIENT_PROTO_JSON_H_

#include <google/protobuf/message.h>

#include <nlohmann/json.hpp>

namespace flatshard {

nlohmann::json ProtoToJson(const google::protobuf::Message& message);

}  // namespace flatshard

#endif  // FLATSHARD_CLIENT_PROTO_JSON_H_
