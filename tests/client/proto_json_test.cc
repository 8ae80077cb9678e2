// JsonWriter against protobuf's own JSON printer: every message of flatshard.proto, empty
// and randomly filled (FLATSHARD_FUZZ_SEED picks other fillings), parses to the same JSON
// in both layouts; the layout itself is nlohmann's; 64-bit counts and non-finite doubles
// keep proto3's forms; bytes that are not UTF-8 are replaced.
#include "client/proto_json.h"

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>

#include "proto/flatshard.pb.h"

namespace flatshard {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// The reference: protobuf's own printer, with the options `flatshard status --json` used.
nlohmann::json LibraryJson(const Message& message) {
  google::protobuf::util::JsonPrintOptions print;
  print.always_print_primitive_fields = true;
  print.preserve_proto_field_names = true;
  std::string text;
  const auto printed = google::protobuf::util::MessageToJsonString(message, &text, print);
  EXPECT_TRUE(printed.ok()) << printed.ToString();
  return nlohmann::json::parse(text);
}

// Fills `message` with random values through reflection: each field set or left unset,
// repeated and map fields of 0-3 entries, integers across their range, doubles including
// NaN, infinities and negative zero, strings with escapes and non-ASCII, any bytes. Floats
// are multiples of 1/4 (protobuf prints them with 6 significant digits, or 9 where 6 do not
// read back: equal to the shortest form only when that is short).
class RandomFiller {
 public:
  explicit RandomFiller(uint64_t seed) : random_(seed) {}

  void Fill(Message& message, int depth) {
    const google::protobuf::Descriptor& descriptor = *message.GetDescriptor();
    for (int i = 0; i < descriptor.field_count(); ++i) {
      const FieldDescriptor& field = *descriptor.field(i);
      if (Coin()) continue;  // left unset: its default
      const int count = field.is_repeated() ? Below(4) : 1;
      for (int j = 0; j < count; ++j) SetOne(message, field, depth);
    }
  }

 private:
  bool Coin() { return Below(2) == 0; }
  int Below(int n) { return std::uniform_int_distribution<int>(0, n - 1)(random_); }
  template <typename T>
  T Any() {
    if (Below(4) == 0) return Below(2) == 0 ? std::numeric_limits<T>::min() : std::numeric_limits<T>::max();
    return std::uniform_int_distribution<T>(std::numeric_limits<T>::min(), std::numeric_limits<T>::max())(random_);
  }
  double AnyDouble() {
    switch (Below(8)) {
      case 0: return std::numeric_limits<double>::quiet_NaN();
      case 1: return Coin() ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
      case 2: return -0.0;
      case 3: return std::numeric_limits<double>::denorm_min();
      default: return std::ldexp(std::uniform_real_distribution<double>(-1, 1)(random_), Below(200) - 100);
    }
  }
  std::string AnyString() {
    static const char* const kPieces[] = {"a", "Z", "0", "\"", "\\", "\n", "\t", "/", "\x01", "\xc3\xa9", "\xe2\x82\xac",
                                          "\xf0\x9f\x98\x80", "<", " "};
    std::string text;
    for (int n = Below(6); n > 0; --n) text += kPieces[Below(std::size(kPieces))];
    return text;
  }
  std::string AnyBytes() {
    std::string bytes(Below(8), '\0');
    for (char& c : bytes) c = static_cast<char>(Below(256));
    return bytes;
  }

  void SetOne(Message& message, const FieldDescriptor& field, int depth) {
    const google::protobuf::Reflection& r = *message.GetReflection();
    const bool repeated = field.is_repeated();
    switch (field.cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        repeated ? r.AddInt32(&message, &field, Any<int32_t>()) : r.SetInt32(&message, &field, Any<int32_t>());
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        repeated ? r.AddUInt32(&message, &field, Any<uint32_t>()) : r.SetUInt32(&message, &field, Any<uint32_t>());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        repeated ? r.AddInt64(&message, &field, Any<int64_t>()) : r.SetInt64(&message, &field, Any<int64_t>());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        repeated ? r.AddUInt64(&message, &field, Any<uint64_t>()) : r.SetUInt64(&message, &field, Any<uint64_t>());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        repeated ? r.AddDouble(&message, &field, AnyDouble()) : r.SetDouble(&message, &field, AnyDouble());
        break;
      case FieldDescriptor::CPPTYPE_FLOAT: {
        const float value = static_cast<float>(Below(4001) - 2000) / 4;
        repeated ? r.AddFloat(&message, &field, value) : r.SetFloat(&message, &field, value);
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL:
        repeated ? r.AddBool(&message, &field, Coin()) : r.SetBool(&message, &field, Coin());
        break;
      case FieldDescriptor::CPPTYPE_ENUM: {
        const int value = field.enum_type()->value(Below(field.enum_type()->value_count()))->number();
        repeated ? r.AddEnumValue(&message, &field, value) : r.SetEnumValue(&message, &field, value);
        break;
      }
      case FieldDescriptor::CPPTYPE_STRING: {
        std::string text = field.type() == FieldDescriptor::TYPE_BYTES ? AnyBytes() : AnyString();
        repeated ? r.AddString(&message, &field, std::move(text)) : r.SetString(&message, &field, std::move(text));
        break;
      }
      case FieldDescriptor::CPPTYPE_MESSAGE: {
        if (depth >= 4) break;
        Message* child = repeated ? r.AddMessage(&message, &field) : r.MutableMessage(&message, &field);
        Fill(*child, depth + 1);
        break;
      }
    }
  }

  std::mt19937_64 random_;
};

uint64_t Seed(uint64_t fixed) {
  const char* seed = std::getenv("FLATSHARD_FUZZ_SEED");
  return seed != nullptr ? std::strtoull(seed, nullptr, 10) : fixed;
}

// `message` written by a JsonWriter with `indent`, parsed.
nlohmann::json WrittenJson(const Message& message, int indent) {
  JsonWriter writer(indent);
  writer.Message(message);
  return nlohmann::json::parse(writer.Take());
}

// Every message of flatshard.proto (status, requests with maps, enums, bytes, oneofs and
// proto3 optionals), empty and randomly filled, prints as protobuf's printer does.
TEST(ProtoJsonTest, EveryMessagePrintsAsTheLibrarysPrinter) {
  const uint64_t seed = Seed(20261127);
  RandomFiller filler(seed);
  const google::protobuf::FileDescriptor& file = *v1::ServerStatus::descriptor()->file();
  ASSERT_GT(file.message_type_count(), 40);
  for (int i = 0; i < file.message_type_count(); ++i) {
    const google::protobuf::Descriptor* descriptor = file.message_type(i);
    const Message* prototype = google::protobuf::MessageFactory::generated_factory()->GetPrototype(descriptor);
    ASSERT_NE(prototype, nullptr) << descriptor->full_name();
    EXPECT_EQ(WrittenJson(*prototype, -1), LibraryJson(*prototype)) << descriptor->full_name() << " empty";
    for (int round = 0; round < 20; ++round) {
      std::unique_ptr<Message> message(prototype->New());
      filler.Fill(*message, 0);
      const nlohmann::json library = LibraryJson(*message);
      for (const int indent : {-1, 2}) {
        const nlohmann::json ours = WrittenJson(*message, indent);
        EXPECT_EQ(ours, library) << descriptor->full_name() << " round " << round << " indent " << indent << " (seed "
                                 << seed << ")\nours:    " << ours.dump() << "\nlibrary: " << library.dump();
      }
    }
  }
}

// What `flatshard status --json` shows: 64-bit counts as strings, a non-finite norm as a
// string, histograms with their bounds, an empty repeated field as [].
TEST(ProtoJsonTest, AStatusKeepsItsNumbersExactly) {
  v1::ServerStatus status;
  status.set_bytes_received(int64_t{1} << 62);
  v1::JobStatus* job = status.add_jobs();
  job->set_last_grad_norm(std::numeric_limits<double>::infinity());
  v1::GroupStatus* group = status.add_groups();
  group->set_load_id(std::numeric_limits<uint64_t>::max());
  group->mutable_reduce_seconds()->add_upper_bounds_seconds(1e-5);
  group->mutable_reduce_seconds()->add_counts(3);
  const nlohmann::json json = WrittenJson(status, -1);
  EXPECT_EQ(json["bytes_received"], "4611686018427387904");
  EXPECT_EQ(json["jobs"][0]["last_grad_norm"], "Infinity");
  EXPECT_EQ(json["groups"][0]["load_id"], "18446744073709551615");
  EXPECT_EQ(json["groups"][0]["reduce_seconds"]["upper_bounds_seconds"], nlohmann::json::array({1e-5}));
  EXPECT_EQ(json["groups"][0]["reduce_seconds"]["counts"], nlohmann::json::array({"3"}));
  EXPECT_EQ(json["groups"][0]["step_contributors"], nlohmann::json::array());
  EXPECT_EQ(json["rank"], 0);
}

// The layout of the text, as nlohmann's dump(indent) lays it out: one member or element
// per line, indented per level, ": " after keys, empty objects and arrays as {} and [];
// with indent -1 no whitespace at all. Fields in declaration order, as protobuf prints.
TEST(ProtoJsonTest, IndentsAsNlohmannDoesAndWritesCompactTextWithoutSpaces) {
  v1::StagedLoad load;
  load.set_name("a \"b\"\n");
  load.set_bytes(5);
  load.set_age_seconds(0.25);
  JsonWriter pretty(2);
  pretty.BeginObject();
  pretty.Key("load");
  pretty.Message(load);
  pretty.Key("empty");
  pretty.BeginArray();
  pretty.EndArray();
  pretty.Key("list");
  pretty.BeginArray();
  pretty.String("x");
  pretty.BeginObject();
  pretty.EndObject();
  pretty.EndArray();
  pretty.EndObject();
  EXPECT_EQ(pretty.Take(),
            "{\n"
            "  \"load\": {\n"
            "    \"name\": \"a \\\"b\\\"\\n\",\n"
            "    \"job\": \"\",\n"
            "    \"load_id\": \"0\",\n"
            "    \"bytes\": \"5\",\n"
            "    \"age_seconds\": 0.25,\n"
            "    \"expires_in_seconds\": 0\n"
            "  },\n"
            "  \"empty\": [],\n"
            "  \"list\": [\n"
            "    \"x\",\n"
            "    {}\n"
            "  ]\n"
            "}");
  JsonWriter compact(-1);
  compact.Message(load);
  EXPECT_EQ(compact.Take(),
            R"({"name":"a \"b\"\n","job":"","load_id":"0","bytes":"5","age_seconds":0.25,"expires_in_seconds":0})");
}

// Bytes that are not UTF-8 (a server's message may quote any) become U+FFFD, not an
// exception.
TEST(ProtoJsonTest, StringsThatAreNotUtf8AreRepaired) {
  JsonWriter json(-1);
  json.String(std::string("ok \xff\xfe end"));
  const nlohmann::json parsed = nlohmann::json::parse(json.Take());
  EXPECT_EQ(parsed.get<std::string>(), "ok \xef\xbf\xbd\xef\xbf\xbd end");
}

}  // namespace
}  // namespace flatshard
