#include "core/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

std::string Path(const std::string& name) {
  return testing::ScratchPath(absl::StrCat(::testing::UnitTest::GetInstance()->current_test_info()->name(), "-", name));
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  auto file = File::Open(path, File::Mode::kWrite);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE(file->Truncate(0).ok());
  ASSERT_TRUE(file->WriteAt(0, absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size())).ok());
}

TEST(SafetensorsTest, HeaderFollowsTheFormatByteForByte) {
  auto header = SafetensorsHeader::Build(
      {{"a", DType::kFloat32, {2}}, {"b.w", DType::kBFloat16, {1, 3}}}, {{"format", "pt"}});
  ASSERT_TRUE(header.ok()) << header.status();
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b.w":{"dtype":"BF16","shape":[1,3],"data_offsets":[8,14]}})";
  const size_t padded = (json.size() + 7) / 8 * 8;
  ASSERT_EQ(header->bytes().size(), 8 + padded);
  std::string bytes(reinterpret_cast<const char*>(header->bytes().data()), header->bytes().size());
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);  // little-endian host
  EXPECT_EQ(length, padded);
  EXPECT_EQ(bytes.substr(8, json.size()), json);
  EXPECT_EQ(bytes.substr(8 + json.size()), std::string(padded - json.size(), ' '));
  EXPECT_EQ(header->file_size(), 8 + padded + 14);
}

TEST(SafetensorsTest, WrittenFileReadsBack) {
  auto header = SafetensorsHeader::Build({{"x", DType::kFloat32, {3}}, {"empty", DType::kFloat16, {0}},
                                          {"s", DType::kFloat64, {}}},
                                         {{"step", "7"}});
  ASSERT_TRUE(header.ok());
  const std::string path = Path("ok.safetensors");
  const float x[3] = {1, 2, 3};
  const double s = 4.5;
  {
    auto file = File::Open(path, File::Mode::kWrite);
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE(file->WriteAt(0, header->bytes()).ok());
    ASSERT_TRUE(file->WriteAt(header->data_start() + header->Find("x")->begin,
                              absl::MakeConstSpan(reinterpret_cast<const std::byte*>(x), 12)).ok());
    ASSERT_TRUE(file->WriteAt(header->data_start() + header->Find("s")->begin,
                              absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&s), 8)).ok());
  }
  auto read = SafetensorsHeader::Read(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->metadata().at("step"), "7");
  ASSERT_NE(read->Find("s"), nullptr);
  EXPECT_EQ(read->Find("s")->dtype, DType::kFloat64);
  EXPECT_TRUE(read->Find("s")->shape.empty());
  EXPECT_EQ(read->data_start(), header->data_start());
  float back[3];
  auto file = File::Open(path, File::Mode::kRead);
  ASSERT_TRUE(file->ReadAt(read->data_start() + read->Find("x")->begin,
                           absl::MakeSpan(reinterpret_cast<std::byte*>(back), 12)).ok());
  EXPECT_EQ(back[2], 3.0f);
}

std::string FileWithHeader(const std::string& json, size_t data_bytes) {
  std::string bytes(8, '\0');
  const uint64_t length = json.size();
  std::memcpy(bytes.data(), &length, 8);
  return bytes + json + std::string(data_bytes, '\0');
}

// A model wrapped module by module has tens of thousands of tensors: the header is
// built and read in time that grows with them, not with their square (ordered_json looked
// each name up among all before it). Names that JSON must escape come back as they were.
TEST(SafetensorsTest, ManyTensorsAndEscapedNamesBuildAndReadBackInTheOrderOfTheirBytes) {
  std::vector<SafetensorsTensor> tensors;
  for (int i = 0; i < 30000; ++i) {
    tensors.push_back({absl::StrCat("layers.", i, i % 2 == 0 ? ".weight" : ".bias"),
                       i % 3 == 0 ? DType::kBFloat16 : DType::kFloat32, {1 + i % 5, 2}});
  }
  tensors.push_back({"q\"uo\\te\n\xc3\xa9", DType::kFloat16, {3}});
  auto built = SafetensorsHeader::Build(tensors, {{"format", "pt"}});
  ASSERT_TRUE(built.ok()) << built.status();
  const std::string bytes(reinterpret_cast<const char*>(built->bytes().data()), built->bytes().size());
  auto read = SafetensorsHeader::Parse(bytes, built->file_size(), "many.safetensors");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->metadata(), built->metadata());
  ASSERT_EQ(read->tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor& want = built->tensors()[i];
    const SafetensorsTensor& got = read->tensors()[i];
    ASSERT_EQ(got.name, want.name) << i;
    EXPECT_EQ(got.dtype, want.dtype) << i;
    EXPECT_EQ(got.shape, want.shape) << i;
    EXPECT_EQ(got.begin, want.begin) << i;
    EXPECT_EQ(got.end, want.end) << i;
    ASSERT_EQ(read->Find(want.name), &got) << i;
    ASSERT_EQ(built->Find(want.name), &want) << i;
  }
  EXPECT_EQ(read->Find("layers.0"), nullptr);

  // Another writer's header may list the tensors in any order; they read back in the
  // order of their bytes.
  const std::string path = Path("reordered.safetensors");
  WriteBytes(path, FileWithHeader(R"({"z":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                  R"("a":{"dtype":"F32","shape":[2],"data_offsets":[12,20]},)"
                                  R"("m":{"dtype":"F64","shape":[1],"data_offsets":[4,12]}})",
                                  20));
  auto reordered = SafetensorsHeader::Read(path);
  ASSERT_TRUE(reordered.ok()) << reordered.status();
  ASSERT_EQ(reordered->tensors().size(), 3u);
  EXPECT_EQ(reordered->tensors()[0].name, "z");
  EXPECT_EQ(reordered->tensors()[1].name, "m");
  EXPECT_EQ(reordered->tensors()[2].name, "a");
  EXPECT_EQ(reordered->Find("a")->begin, 12u);

  // Fields of a tensor the format does not define are passed over, however nested, and
  // the fields may come in any order; __metadata__ may come anywhere.
  const std::string extra = Path("extra.safetensors");
  WriteBytes(extra, FileWithHeader(R"({"b":{"data_offsets":[8,10],"x":{"y":[1,{"z":[]}],"w":null},)"
                                   R"("shape":[],"dtype":"BF16"},"__metadata__":{"format":"pt","k":"v"},)"
                                   R"("a":{"dtype":"I64","shape":[1,1],"data_offsets":[0,8],"q":[[true]]}})",
                                   10));
  auto with_extra = SafetensorsHeader::Read(extra);
  ASSERT_TRUE(with_extra.ok()) << with_extra.status();
  ASSERT_EQ(with_extra->tensors().size(), 2u);
  EXPECT_EQ(with_extra->tensors()[0].name, "a");
  EXPECT_EQ(with_extra->tensors()[0].dtype, DType::kInt64);
  EXPECT_EQ(with_extra->tensors()[0].shape, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(with_extra->tensors()[1].name, "b");
  EXPECT_EQ(with_extra->tensors()[1].dtype, DType::kBFloat16);
  EXPECT_TRUE(with_extra->tensors()[1].shape.empty());
  EXPECT_EQ(with_extra->tensors()[1].begin, 8u);
  EXPECT_EQ(with_extra->metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"k", "v"}}));
}


TEST(SafetensorsTest, DamagedFilesAreRefusedNamingTheProblem) {
  struct Case {
    std::string bytes;
    std::string message;
  };
  const Case cases[] = {
      {"abc", "shorter than the 8-byte header length"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "the file has"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12), "the file has"},
      {FileWithHeader(R"({"a": [)", 0), "malformed JSON header"},
      {FileWithHeader(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "do not match"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "hole"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "needs dtype, shape and data_offsets"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8), "needs dtype, shape"},
      {FileWithHeader(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", 8), "needs dtype, shape"},
      {FileWithHeader(R"({"a":[]})", 8), "tensor 'a' needs dtype, shape"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}})", 8), "tensor 'a': bad shape"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", 8), "tensor 'a': bad shape"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})", 8), "bad data_offsets"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}})", 8), "bad data_offsets"},
      {FileWithHeader(R"([{"dtype":"F32"}])", 0), "the header is not a JSON object"},
      {FileWithHeader(R"({"__metadata__":{"format":1}})", 0), "__metadata__['format'] is not a string"},
      {FileWithHeader(R"({"__metadata__":"pt"})", 0), "__metadata__ is not an object"},
      // A number no double holds: nlohmann's out_of_range, which the DOM parser threw.
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8e999]}})", 8), "malformed JSON header"},
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":-1E400}})", 8),
       "malformed JSON header"},
      // A problem with the contents first, the JSON malformed later: malformed it is.
      {FileWithHeader(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}} x)", 8), "malformed JSON header"},
      // JSON allows a key twice; a header of tensors that tile the file must not.
      {FileWithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                      16),
       "tensor 'a' is listed twice"},
      {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "does not fit"},
      // 2^61 float64 elements are 2^64 bytes: 0 once wrapped around.
      {FileWithHeader(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0),
       "do not match"},
  };
  for (size_t i = 0; i < std::size(cases); ++i) {
    const std::string path = Path(absl::StrCat(i, ".safetensors"));
    WriteBytes(path, cases[i].bytes);
    auto read = SafetensorsHeader::Read(path);
    ASSERT_FALSE(read.ok()) << i;
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << i;
    EXPECT_THAT(std::string(read.status().message()), HasSubstr(cases[i].message)) << i;
    EXPECT_THAT(std::string(read.status().message()), HasSubstr(path)) << i;
  }
}

// Random damage to a valid header: every outcome is DataLoss naming the file, or a header
// whose tensors tile the data exactly, match their shapes and fit the file; never a
// crash, an exception or an offset out of range. The sanitizer build runs it under
// AddressSanitizer.
TEST(SafetensorsTest, RandomlyDamagedHeadersAreRefusedOrConsistent) {
  auto built = SafetensorsHeader::Build({{"w", DType::kFloat32, {3, 5}}, {"b", DType::kBFloat16, {7}},
                                         {"s", DType::kFloat16, {}}, {"e", DType::kInt64, {0, 4}}},
                                        {{"format", "pt"}});
  ASSERT_TRUE(built.ok()) << built.status();
  const std::string valid(reinterpret_cast<const char*>(built->bytes().data()), built->bytes().size());
  const std::string alphabet = "{}[]\":,0123456789-+eE.FBIU_ \\a\xff";
  std::mt19937 rng(20261123);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = valid;
    for (int flips = 1 + static_cast<int>(rng() % 4); flips > 0; --flips) {
      const size_t at = 8 + rng() % (bytes.size() - 8);  // the JSON text: the length stays right
      bytes[at] = rng() % 4 == 0 ? static_cast<char>(rng()) : alphabet[rng() % alphabet.size()];
    }
    const uint64_t file_size = built->file_size() + (rng() % 8 == 0 ? rng() % 64 - 32 : 0);
    auto header = SafetensorsHeader::Parse(bytes, file_size, "fuzz.safetensors");
    if (!header.ok()) {
      EXPECT_EQ(header.status().code(), absl::StatusCode::kDataLoss) << header.status();
      EXPECT_THAT(std::string(header.status().message()), HasSubstr("fuzz.safetensors"));
      continue;
    }
    ++accepted;
    EXPECT_EQ(header->file_size(), file_size);
    uint64_t covered = 0;
    for (const SafetensorsTensor& t : header->tensors()) {
      uint64_t numel = 1;
      for (int64_t dim : t.shape) numel *= static_cast<uint64_t>(dim);
      EXPECT_LE(t.begin, t.end) << bytes;
      EXPECT_LE(header->data_start() + t.end, file_size) << bytes;
      EXPECT_EQ(t.end - t.begin, numel * DTypeSize(t.dtype)) << bytes;
      covered += t.end - t.begin;
    }
    EXPECT_EQ(header->data_start() + covered, file_size) << bytes;
  }
  // Damage to names, metadata and spaces still parses.
  EXPECT_GT(accepted, 0);
}

TEST(SafetensorsTest, BuildRefusesBadNames) {
  EXPECT_FALSE(SafetensorsHeader::Build({{"", DType::kFloat32, {1}}}, {}).ok());
  EXPECT_FALSE(SafetensorsHeader::Build({{"__metadata__", DType::kFloat32, {1}}}, {}).ok());
  EXPECT_FALSE(SafetensorsHeader::Build({{"a", DType::kFloat32, {1}}, {"a", DType::kFloat32, {1}}}, {}).ok());
  EXPECT_FALSE(SafetensorsHeader::Build({{"a", DType::kFloat32, {-1}}}, {}).ok());
}

TEST(FileTest, AtomicWriteReplacesWholeFiles) {
  const std::string path = Path("manifest.json");
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "second").ok());
  EXPECT_EQ(*ReadFileToString(path), "second");
  EXPECT_EQ(ReadFileToString(Path("missing")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace flatshard
