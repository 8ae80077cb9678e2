// CheckpointReader against files written through DirectorySink: the bytes it delivers
// equal what was written (from the page cache and, after the cache is dropped, through
// O_DIRECT; across extents and tasks; converted from bf16), and every kind of damage is
// DataLoss naming the file, on either path. Read through a RemoteRead (a checkpoint in
// another server's root), the same holds.
#include "server/checkpoint_reader.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/float_bits.h"
#include "server/checkpoint_sink.h"
#include "tests/scratch_dir.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

std::string FreshDir() {
  const std::string dir =
      testing::ScratchPath(absl::StrCat("reader-", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

absl::Span<const std::byte> AsBytes(const std::vector<float>& v) {
  return {reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float)};
}

// A file written the way saves write (through DirectorySink): a 24-byte "header", then
// `values` in slices of `slice` floats. Its manifest lists the header and each slice as an
// extent of its own, as a FULL checkpoint lists the interleaved pieces of several servers
// (DirectorySink joins one writer's contiguous writes; the reader takes any tiling).
struct WrittenFile {
  std::vector<float> values;
  ManifestFile manifest;
};

WrittenFile Write(const std::string& dir, const std::string& name, size_t count, size_t slice, uint32_t seed) {
  WrittenFile written;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  written.values.resize(count);
  for (float& v : written.values) v = dist(rng);
  DirectorySink sink(dir);
  const std::vector<std::byte> header(24, std::byte{'h'});
  EXPECT_TRUE(sink.Open(name, header.size() + count * sizeof(float), true).ok());
  EXPECT_TRUE(sink.Write(name, 0, header).ok());
  for (size_t done = 0; done < count; done += slice) {
    const size_t n = std::min(slice, count - done);
    EXPECT_TRUE(sink.Write(name, header.size() + done * sizeof(float),
                           AsBytes(written.values).subspan(done * sizeof(float), n * sizeof(float)))
                    .ok());
  }
  EXPECT_TRUE(sink.Close(name).ok());
  written.manifest.bytes = header.size() + count * sizeof(float);
  written.manifest.extents.push_back({0, header.size(), Xxh3(header)});
  for (size_t done = 0; done < count; done += slice) {
    const auto bytes =
        AsBytes(written.values).subspan(done * sizeof(float), std::min(slice, count - done) * sizeof(float));
    written.manifest.extents.push_back({header.size() + done * sizeof(float), bytes.size(), Xxh3(bytes)});
  }
  EXPECT_TRUE(SortAndCheckTiling(written.manifest.extents, written.manifest.bytes, name).ok());
  return written;
}

// Saves write around the page cache (O_DIRECT); reading a file fills it.
void FillPageCache(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> buffer(1 << 20);
  while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0) {
  }
}

void DropPageCache(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

TEST(CheckpointReaderTest, DeliversExactlyTheWrittenBytesWarmAndCold) {
  const std::string dir = FreshDir();
  // 40 MiB of floats in 1 MiB extents: several 16 MiB tasks per read, on 4 threads.
  const size_t count = size_t{10} << 20;
  WrittenFile file = Write(dir, "big.safetensors", count, size_t{1} << 18, 1);
  ReadBufferPool pool;
  for (const bool cold : {false, true}) {
    if (cold) {
      DropPageCache(dir + "/big.safetensors");
    } else {
      FillPageCache(dir + "/big.safetensors");
    }
    CheckpointReader reader(dir, {{"big.safetensors", file.manifest}}, pool,
                            ReaderOptions{.threads = 4, .task_bytes = uint64_t{16} << 20});
    // Whole, a range that starts and ends inside extents, and a single element.
    std::vector<float> whole(count, -7), middle(3'000'001, -7), one(1, -7);
    ASSERT_TRUE(reader.Add("big.safetensors", 24, DType::kFloat32, count, whole.data()).ok());
    ASSERT_TRUE(reader.Add("big.safetensors", 24 + 4 * 123'457, DType::kFloat32, middle.size(), middle.data()).ok());
    ASSERT_TRUE(reader.Add("big.safetensors", 24 + 4 * (count - 1), DType::kFloat32, 1, one.data()).ok());
    ProgressCounter progress;
    ASSERT_TRUE(reader.Run(&progress).ok()) << (cold ? "cold" : "warm");
    EXPECT_EQ(whole, file.values) << (cold ? "cold" : "warm");
    // Every requested byte counted once, including those two requests share.
    EXPECT_EQ(progress.total.load(), 4 * (count + middle.size() + 1));
    EXPECT_EQ(progress.done.load(), progress.total.load());
    EXPECT_TRUE(std::equal(middle.begin(), middle.end(), file.values.begin() + 123'457));
    EXPECT_EQ(one[0], file.values.back());
    absl::StatusOr<std::string> header = reader.ReadNow("big.safetensors", 3, 10);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(*header, std::string(10, 'h'));
  }
}

// A file of many small tensors (a model wrapped in one group): an extent and a request
// per tensor, all in one task, beside requests that straddle extents and one that spans
// them all; each gets exactly its bytes (the task's requests are swept in order as its
// extents go by).
TEST(CheckpointReaderTest, ManySmallRequestsAmongManyExtentsEachGetTheirBytes) {
  const std::string dir = FreshDir();
  constexpr size_t kTensors = 20000, kNumel = 16;
  WrittenFile file = Write(dir, "small.safetensors", kTensors * kNumel, kNumel, 7);
  ReadBufferPool pool;
  CheckpointReader reader(dir, {{"small.safetensors", file.manifest}}, pool,
                          ReaderOptions{.threads = 2, .task_bytes = uint64_t{64} << 20});
  std::vector<std::vector<float>> tensors(kTensors, std::vector<float>(kNumel, -7));
  for (size_t t = 0; t < kTensors; ++t) {
    ASSERT_TRUE(reader.Add("small.safetensors", 24 + 4 * t * kNumel, DType::kFloat32, kNumel, tensors[t].data()).ok());
  }
  std::vector<std::vector<float>> straddling(100, std::vector<float>(kNumel, -7));
  for (size_t s = 0; s < straddling.size(); ++s) {
    const size_t first = (s * 197 + 5) * kNumel + kNumel / 2;  // half of one tensor, half of the next
    ASSERT_TRUE(reader.Add("small.safetensors", 24 + 4 * first, DType::kFloat32, kNumel, straddling[s].data()).ok());
  }
  std::vector<float> all(kTensors * kNumel, -7);
  ASSERT_TRUE(reader.Add("small.safetensors", 24, DType::kFloat32, all.size(), all.data()).ok());
  ASSERT_TRUE(reader.Run(nullptr).ok());
  for (size_t t = 0; t < kTensors; ++t) {
    ASSERT_TRUE(std::equal(tensors[t].begin(), tensors[t].end(), file.values.begin() + t * kNumel)) << "tensor " << t;
  }
  for (size_t s = 0; s < straddling.size(); ++s) {
    const size_t first = (s * 197 + 5) * kNumel + kNumel / 2;
    ASSERT_TRUE(std::equal(straddling[s].begin(), straddling[s].end(), file.values.begin() + first))
        << "straddling " << s;
  }
  EXPECT_EQ(all, file.values);
}

TEST(CheckpointReaderTest, ConvertsHalfPrecisionToFloat) {
  const std::string dir = FreshDir();
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7f80, 0x0001, 0x4049};
  DirectorySink sink(dir);
  const absl::Span<const std::byte> bytes(reinterpret_cast<const std::byte*>(bf16.data()), bf16.size() * 2);
  ASSERT_TRUE(sink.Open("h", bytes.size(), true).ok());
  ASSERT_TRUE(sink.Write("h", 0, bytes.subspan(0, 4)).ok());
  ASSERT_TRUE(sink.Write("h", 4, bytes.subspan(4)).ok());
  ASSERT_TRUE(sink.Close("h").ok());
  ManifestFile manifest{bytes.size(), sink.extents().at("h")};
  ReadBufferPool pool;
  CheckpointReader reader(dir, {{"h", manifest}}, pool);
  std::vector<float> out(4);
  ASSERT_TRUE(reader.Add("h", 2, DType::kBFloat16, 4, out.data()).ok());
  ASSERT_TRUE(reader.Run().ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], BFloat16BitsToFloat(bf16[i + 1])) << i;
}

TEST(CheckpointReaderTest, DamageIsDataLossNamingTheFileAndBytes) {
  const std::string dir = FreshDir();
  WrittenFile file = Write(dir, "f.safetensors", 1 << 20, 1 << 16, 2);
  const std::string path = dir + "/f.safetensors";
  ReadBufferPool pool;
  std::vector<float> out(file.values.size());
  auto read_all = [&](ManifestFile manifest) {
    CheckpointReader reader(dir, {{"f.safetensors", manifest}}, pool);
    absl::Status status = reader.Add("f.safetensors", 24, DType::kFloat32, out.size(), out.data());
    return status.ok() ? reader.Run() : status;
  };
  ASSERT_TRUE(read_all(file.manifest).ok());

  {  // one flipped byte in the fifth extent, read from the page cache and from the disk
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(24 + 4 * (4 << 16) + 5);
    f.put('\x42');
  }
  for (const bool cold : {false, true}) {
    if (cold) {
      DropPageCache(path);
    } else {
      FillPageCache(path);
    }
    absl::Status flipped = read_all(file.manifest);
    EXPECT_EQ(flipped.code(), absl::StatusCode::kDataLoss) << (cold ? "cold" : "warm");
    EXPECT_THAT(std::string(flipped.message()), HasSubstr("f.safetensors' is corrupted: bytes [1048600, 1310744)"));
  }

  std::filesystem::resize_file(path, file.manifest.bytes - 1);
  absl::Status truncated = read_all(file.manifest);
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(truncated.message()), HasSubstr("truncated"));

  CheckpointReader reader(dir, {{"f.safetensors", file.manifest}}, pool);
  EXPECT_EQ(reader.Add("other.safetensors", 0, DType::kFloat32, 1, out.data()).code(), absl::StatusCode::kDataLoss);
  std::filesystem::remove(path);
  EXPECT_EQ(reader.Add("f.safetensors", 0, DType::kFloat32, 1, out.data()).code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointReaderTest, ReadsPastTheEndAreRefused) {
  const std::string dir = FreshDir();
  WrittenFile file = Write(dir, "f", 100, 10, 3);
  ReadBufferPool pool;
  CheckpointReader reader(dir, {{"f", file.manifest}}, pool);
  std::vector<float> out(101);
  absl::Status status = reader.Add("f", 24, DType::kFloat32, 101, out.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("101 float32 elements at byte 24 lie past its end"));
  // An offset and a count whose byte range wraps around 2^64 do not slip past the check.
  for (const auto& [offset, count] : std::vector<std::pair<uint64_t, int64_t>>{
           {~uint64_t{0} - 3, 2}, {8, int64_t{1} << 62}, {425, 0}}) {
    EXPECT_EQ(reader.Add("f", offset, DType::kFloat32, count, out.data()).code(), absl::StatusCode::kDataLoss)
        << offset << " + " << count;
  }
}

// Another server's root, stood in for by the local file: whole tasks are fetched, every
// extent verified; a flipped byte in transit and a failing fetch are refused.
TEST(CheckpointReaderTest, RemoteReadsAreVerifiedLikeLocalOnes) {
  const std::string dir = FreshDir();
  // 24 MiB in 256 KiB extents: two 16 MiB tasks, read by two threads at once.
  WrittenFile file = Write(dir, "r.safetensors", size_t{6} << 20, size_t{1} << 16, 4);
  std::atomic<int> fetches{0};
  std::atomic<bool> flip{false}, fail{false};
  RemoteRead remote = [&](const std::string& name, uint64_t offset, uint64_t length, std::byte* out) {
    ++fetches;
    if (fail) return absl::UnavailableError("server 0 went away");
    std::ifstream in(dir + "/" + name, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(reinterpret_cast<char*>(out), static_cast<std::streamsize>(length));
    if (static_cast<uint64_t>(in.gcount()) != length) return absl::DataLossError("short");
    if (flip) out[length / 2] ^= std::byte{1};
    return absl::OkStatus();
  };
  ReadBufferPool pool;
  auto read_all = [&](std::vector<float>& out) {
    CheckpointReader reader("server 0 (x) ckpt", {{"r.safetensors", file.manifest}}, pool, remote,
                            ReaderOptions{.threads = 2, .task_bytes = uint64_t{16} << 20});
    absl::Status status = reader.Add("r.safetensors", 24, DType::kFloat32, out.size(), out.data());
    return status.ok() ? reader.Run() : status;
  };
  std::vector<float> out(file.values.size(), -7);
  ASSERT_TRUE(read_all(out).ok());
  EXPECT_EQ(out, file.values);
  EXPECT_EQ(fetches.load(), 2);  // whole tasks, not extent by extent

  flip = true;
  absl::Status flipped = read_all(out);
  EXPECT_EQ(flipped.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(flipped.message()), HasSubstr("'server 0 (x) ckpt/r.safetensors' is corrupted"));
  flip = false;
  fail = true;
  EXPECT_THAT(std::string(read_all(out).message()), HasSubstr("server 0 went away"));
}

}  // namespace
}  // namespace flatshard::server
