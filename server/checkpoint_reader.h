// CheckpointReader: verified, parallel reads of the files of a committed checkpoint.
//
// The manifest lists every file's size and extents (server/file_extents.h): byte ranges
// that a saving server hashed as it wrote them. A read is widened to whole extents and
// every extent is hashed and compared before any of its bytes are handed out, so a load
// checks exactly the bytes it uses, in the pass that reads them.
//
// Reads are queued (Add) and then run together (Run): the bytes each file needs are cut
// into tasks of whole extents, up to 64 MiB, which two threads read, verify and deliver
// (copied, or converted to fp32). A task reads from the page cache where it already holds
// the bytes (preadv2 with RWF_NOWAIT) and with O_DIRECT otherwise: a disk's sequential
// rate needs large requests in flight, which buffered reads with readahead do not issue.
// Where O_DIRECT is refused (tmpfs, some network file systems), plain reads. A checkpoint
// kept in another server's root is read through a RemoteRead (a task at a time) and
// verified the same way.
//
// Errors name the file: NotFound, DataLoss (a size other than the manifest's, an extent
// whose checksum does not match, a read past the end). Memory: one task buffer per
// thread. Not thread-safe; Run uses threads of its own and returns when they are done.
//
//   CheckpointReader reader(dir, files);  // files: from the manifest
//   FLATSHARD_ASSIGN_OR_RETURN(SafetensorsHeader header, reader.ReadHeader("model.safetensors"));
//   FLATSHARD_RETURN_IF_ERROR(reader.Add("model.safetensors", offset, DType::kBFloat16, n, out));
//   FLATSHARD_RETURN_IF_ERROR(reader.Run());
#ifndef FLATSHARD_SERVER_CHECKPOINT_READER_H_
#define FLATSHARD_SERVER_CHECKPOINT_READER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/direct_io.h"
#include "core/dtype.h"
#include "core/safetensors.h"
#include "server/checkpoint_progress.h"
#include "server/file_extents.h"

namespace flatshard::server {

// Read buffers kept from one load to the next: fresh memory costs a page fault and a
// zeroed page on first touch, which was a third of a warm load's time. Holds what the
// last load's threads used (threads x task bytes). Thread-safe.
class ReadBufferPool {
 public:
  std::unique_ptr<DirectIoBuffer> Take();
  void Give(std::unique_ptr<DirectIoBuffer> buffer);

 private:
  absl::Mutex mu_;
  std::vector<std::unique_ptr<DirectIoBuffer>> free_ ABSL_GUARDED_BY(mu_);
};

// A file as the manifest lists it.
struct ManifestFile {
  uint64_t bytes = 0;
  std::vector<FileExtent> extents;  // sorted, tiling [0, bytes)
};

// Fills `out` with `length` bytes at `offset` of checkpoint file `file` held elsewhere
// (another server's root); called from several threads at once.
using RemoteRead =
    std::function<absl::Status(const std::string& file, uint64_t offset, uint64_t length, std::byte* out)>;

struct ReaderOptions {
  int threads = 2;  // >= 1
  // Bytes per task. A disk streams at its sequential rate only with enough bytes in flight:
  // one O_DIRECT read of a task is split into the device's largest requests (4 MiB here)
  // and issued at once, and a thread verifies and delivers its task while the other reads.
  // Measured on the dev VM's disk (cluster_bench, cold loads of 512 MiB on 2 servers):
  // 4 MiB tasks on 4 threads read 1.0-1.6 GB/s, 16 MiB on 4 threads 1.2-2.5, 64 MiB on 2
  // threads 2.6-3.7 (bench/RESULTS.md). Cached extents are read and verified one at a
  // time whatever the task size, so warm loads stay in the CPU's caches.
  uint64_t task_bytes = uint64_t{64} << 20;
  // Asked before each task (may be empty): once it says true (the load's client went
  // away), Run stops, Cancelled.
  std::function<bool()> cancelled = nullptr;
};

class CheckpointReader {
 public:
  // `files` by path relative to `dir`; buffers from `pool`, which must outlive the reader.
  CheckpointReader(std::string dir, std::map<std::string, ManifestFile> files, ReadBufferPool& pool,
                   ReaderOptions options = {});
  // The files are read through `remote`; `where` names their place in messages.
  CheckpointReader(std::string where, std::map<std::string, ManifestFile> files, ReadBufferPool& pool,
                   RemoteRead remote, ReaderOptions options = {});
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // Reads and verifies now: `length` bytes at `offset` of `file` (small reads: headers,
  // JSON indexes). The whole file with ReadWhole.
  [[nodiscard]] absl::StatusOr<std::string> ReadNow(const std::string& file, uint64_t offset, uint64_t length);
  [[nodiscard]] absl::StatusOr<std::string> ReadWhole(const std::string& file);
  // The verified, validated safetensors header of `file`.
  [[nodiscard]] absl::StatusOr<SafetensorsHeader> ReadHeader(const std::string& file);

  // Queues `count` elements of `dtype` at byte `offset` of `file`, to be delivered to
  // `out` as fp32 by Run. DataLoss if they lie past the end of the file.
  [[nodiscard]] absl::Status Add(const std::string& file, uint64_t offset, DType dtype, int64_t count, float* out);
  // Reads, verifies and delivers every queued read; the first error, if any (then some
  // destinations may be partly written; Cancelled once ReaderOptions::cancelled says so). The queue is empty
  // afterwards. `progress` (optional): the queued bytes are added to its total, and to done as delivered.
  [[nodiscard]] absl::Status Run(ProgressCounter* progress = nullptr);

  std::string path(const std::string& file) const { return dir_ + "/" + file; }
  // Whether the manifest lists `file`.
  bool lists(const std::string& file) const { return files_.count(file) > 0; }

 private:
  struct OpenedFile;
  struct Request;
  struct Task;

  absl::StatusOr<OpenedFile*> Open(const std::string& file);
  // Reads [task.begin, task.end) into `buffer`, verifies its extents and delivers it.
  absl::Status Execute(const Task& task, DirectIoBuffer& buffer) const;

  const std::string dir_;
  const std::map<std::string, ManifestFile> files_;
  ReadBufferPool& pool_;
  const int threads_;
  const uint64_t task_bytes_;
  const std::function<bool()> cancelled_;
  RemoteRead remote_;  // null: files under dir_
  ProgressCounter* progress_ = nullptr;  // during Run
  std::map<std::string, std::unique_ptr<OpenedFile>> opened_;
  std::vector<Request> requests_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_READER_H_
