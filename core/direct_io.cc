#include "core/direct_io.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/huge_pages.h"
#include "core/status_macros.h"

namespace flatshard {
namespace {
constexpr uint64_t kHugePage = uint64_t{2} << 20;
// Bytes gathered before a direct write: large enough for the disk to stream.
constexpr uint64_t kBlockBytes = uint64_t{16} << 20;
// Whole pages of a run fewer than this go through the page cache with its edges: an
// O_DIRECT write waits for the disk, ~0.1 ms even for one page, while a buffered one is a
// copy (Close's fsync writes them all at once). A FULL save of a model of many small
// tensors writes one short run per tensor and server.
constexpr uint64_t kMinDirectBytes = uint64_t{1} << 20;
}  // namespace

DirectIoBuffer::~DirectIoBuffer() { std::free(data_); }

DirectIoBuffer& DirectIoBuffer::operator=(DirectIoBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

std::byte* DirectIoBuffer::Reserve(uint64_t bytes) {
  if (bytes > capacity_) {
    std::free(data_);
    capacity_ = (bytes + kHugePage - 1) & ~(kHugePage - 1);
    data_ = static_cast<std::byte*>(std::aligned_alloc(kHugePage, capacity_));
    if (data_ == nullptr) throw std::bad_alloc();
    AdviseHugePages(data_, capacity_);
  }
  return data_;
}

absl::StatusOr<DirectFileWriter> DirectFileWriter::Open(const std::string& path, uint64_t size, bool truncate) {
  FLATSHARD_ASSIGN_OR_RETURN(File buffered, File::Open(path, File::Mode::kWrite));
  if (truncate) {
    FLATSHARD_RETURN_IF_ERROR(buffered.Truncate(0));
    FLATSHARD_RETURN_IF_ERROR(buffered.Reserve(size));
  } else {
    // A file other writers fill too gets the same size from each. Reserving it made
    // FULL saves on a shared root ~15% slower (bench/RESULTS.md): only its room is checked.
    FLATSHARD_RETURN_IF_ERROR(buffered.CheckRoom(size));
    FLATSHARD_RETURN_IF_ERROR(buffered.Truncate(size));
  }
  absl::StatusOr<File> direct = File::Open(path, File::Mode::kWriteDirect);
  return DirectFileWriter(std::move(buffered), direct.ok() ? std::optional<File>(*std::move(direct)) : std::nullopt);
}

absl::Status DirectFileWriter::Write(uint64_t offset, absl::Span<const std::byte> data) {
  if (!in_run_ || offset != run_end_) {
    FLATSHARD_RETURN_IF_ERROR(WriteOut());
    in_run_ = true;
    run_start_ = run_end_ = offset;
    base_ = AlignDown(offset);
  }
  std::byte* block = block_.Reserve(kBlockBytes);
  while (!data.empty()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(base_ + kBlockBytes - run_end_, data.size()));
    std::memcpy(block + (run_end_ - base_), data.data(), n);
    run_end_ += n;
    data.remove_prefix(n);
    if (run_end_ == base_ + kBlockBytes) {
      FLATSHARD_RETURN_IF_ERROR(WriteOut());
      base_ += kBlockBytes;
    }
  }
  return absl::OkStatus();
}

absl::Status DirectFileWriter::WriteOut() {
  const uint64_t lo = std::max(run_start_, base_);
  const uint64_t hi = run_end_;
  if (!in_run_ || lo >= hi) return absl::OkStatus();
  const std::byte* block = block_.data();
  auto buffered = [&](uint64_t from, uint64_t to) {
    return from < to ? buffered_.WriteAt(from, absl::MakeConstSpan(block + (from - base_), to - from))
                     : absl::OkStatus();
  };
  const uint64_t direct_lo = AlignUp(lo), direct_hi = AlignDown(hi);
  if (!direct_.has_value() || direct_lo >= direct_hi || direct_hi - direct_lo < kMinDirectBytes) {
    return buffered(lo, hi);
  }
  FLATSHARD_RETURN_IF_ERROR(buffered(lo, direct_lo));
  if (!direct_->WriteAt(direct_lo, absl::MakeConstSpan(block + (direct_lo - base_), direct_hi - direct_lo)).ok()) {
    // A file system that opens with O_DIRECT but refuses the write (some FUSE and network
    // file systems): the page cache from here on. A failing disk fails this write too.
    direct_.reset();
    FLATSHARD_RETURN_IF_ERROR(buffered(direct_lo, direct_hi));
  }
  return buffered(direct_hi, hi);
}

absl::Status DirectFileWriter::Close() {
  FLATSHARD_RETURN_IF_ERROR(WriteOut());
  in_run_ = false;
  return buffered_.Sync();
}

}  // namespace flatshard
