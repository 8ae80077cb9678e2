// O_DIRECT helpers for checkpoint files: the alignment direct I/O needs and a buffer that
// meets it. Direct reads and writes move a checkpoint at the disk's rate without copying
// it through the page cache; on the dev machine, 16 MiB O_DIRECT writes from two writers
// reach 2.9 GB/s where buffered writes of new files reach 0.3-0.5 GB/s.
//
// DirectFileWriter: writes a file, which other writers may be filling at their own byte
// ranges, through O_DIRECT where it can. Consecutive writes form a run, gathered into
// 16 MiB blocks aligned with the file; a block's whole 4 KiB pages go out with O_DIRECT,
// the partial pages at a run's two ends through the page cache (another writer may own
// the rest of such a page; the page cache merges both), and so does all of a run's part
// of a block with less than 1 MiB of whole pages (a small tensor's piece). Where the file
// system refuses O_DIRECT (at open, or at a write), the rest goes through the page cache.
// Not thread-safe; movable.
//
//   FLATSHARD_ASSIGN_OR_RETURN(DirectFileWriter writer, DirectFileWriter::Open(path, size, true));
//   FLATSHARD_RETURN_IF_ERROR(writer.Write(offset, bytes));   // any offsets; runs stream
//   FLATSHARD_RETURN_IF_ERROR(writer.Close());                 // flush + fsync
//
// DirectIoBuffer: grows on demand, aligned to 2 MiB and advised for huge pages (a direct
// transfer pins its buffer's pages, which costs per page). Not thread-safe; movable.
//
//   DirectIoBuffer buffer;
//   std::byte* data = buffer.Reserve(AlignUp(bytes));
//   pread(direct_fd, data, AlignUp(bytes), AlignDown(offset));
#ifndef FLATSHARD_CORE_DIRECT_IO_H_
#define FLATSHARD_CORE_DIRECT_IO_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/file.h"

namespace flatshard {

// Offsets, lengths and addresses of O_DIRECT transfers are multiples of the logical block
// size; 4 KiB covers every common device.
inline constexpr uint64_t kDirectIoAlign = 4096;
inline uint64_t AlignDown(uint64_t value) { return value & ~(kDirectIoAlign - 1); }
inline uint64_t AlignUp(uint64_t value) { return AlignDown(value + kDirectIoAlign - 1); }

class DirectIoBuffer {
 public:
  DirectIoBuffer() = default;
  ~DirectIoBuffer();
  DirectIoBuffer(DirectIoBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), capacity_(std::exchange(other.capacity_, 0)) {}
  DirectIoBuffer& operator=(DirectIoBuffer&& other) noexcept;
  DirectIoBuffer(const DirectIoBuffer&) = delete;
  DirectIoBuffer& operator=(const DirectIoBuffer&) = delete;

  // At least `bytes`; the contents are not kept when it grows.
  std::byte* Reserve(uint64_t bytes);
  std::byte* data() const { return data_; }

 private:
  std::byte* data_ = nullptr;
  uint64_t capacity_ = 0;
};

class DirectFileWriter {
 public:
  // Opens (creating) `path` and sets its size to `size`; `truncate` drops old contents
  // first (a file this writer alone fills) and allocates the file's blocks (File::Reserve),
  // otherwise the file system's room for it is only checked (File::CheckRoom). Either
  // way a disk or file size limit without room for the file fails here.
  [[nodiscard]] static absl::StatusOr<DirectFileWriter> Open(const std::string& path, uint64_t size,
                                                            bool truncate);
  DirectFileWriter(DirectFileWriter&&) noexcept = default;
  DirectFileWriter& operator=(DirectFileWriter&&) noexcept = default;

  [[nodiscard]] absl::Status Write(uint64_t offset, absl::Span<const std::byte> data);
  // Writes what is gathered and fsyncs: the bytes written are durable.
  [[nodiscard]] absl::Status Close();

 private:
  DirectFileWriter(File buffered, std::optional<File> direct)
      : buffered_(std::move(buffered)), direct_(std::move(direct)) {}
  // Writes the gathered bytes of the current run, [max(run_start_, base_), run_end_).
  absl::Status WriteOut();

  File buffered_;
  std::optional<File> direct_;  // absent where O_DIRECT is refused
  DirectIoBuffer block_;        // file bytes [base_, base_ + block size)
  bool in_run_ = false;
  uint64_t run_start_ = 0, run_end_ = 0, base_ = 0;
};

}  // namespace flatshard

#endif  // FLATSHARD_CORE_DIRECT_IO_H_
