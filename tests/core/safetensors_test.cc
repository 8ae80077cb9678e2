#include "core/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "core/file.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

std::string Path(const std::string& name) {
  return ::testing::TempDir() + "/" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-" + name;
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
      {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "does not fit"},
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
