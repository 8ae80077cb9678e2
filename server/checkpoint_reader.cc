#include "server/checkpoint_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "kernels/kernels.h"

namespace flatshard::server {
namespace {


absl::Status CorruptExtent(const std::string& path, const FileExtent& e) {
  return absl::DataLossError(absl::StrCat("'", path, "' is corrupted: bytes [", e.offset, ", ", e.offset + e.length,
                                          ") do not match their XXH3 checksum in the manifest"));
}

absl::Status ReadError(const std::string& path, int err) {
  return absl::InternalError(absl::StrCat("read '", path, "': ", std::strerror(err)));
}

}  // namespace

struct CheckpointReader::OpenedFile {
  std::string name;  // as the manifest lists it
  std::string path;
  const ManifestFile* manifest;
  int fd = -1;         // buffered
  int direct_fd = -1;  // O_DIRECT; -1 where the file system refuses it
  ~OpenedFile() {
    if (fd >= 0) close(fd);
    if (direct_fd >= 0) close(direct_fd);
  }
};

struct CheckpointReader::Request {
  OpenedFile* file;
  uint64_t begin, end;  // bytes of the file
  DType dtype;
  float* out;
};

// Whole extents [first_extent, last_extent] of one file, and the requests they serve.
struct CheckpointReader::Task {
  OpenedFile* file;
  size_t first_extent, last_extent;
  uint64_t begin, end;
  std::vector<const Request*> requests;  // those that need its bytes, sorted by their begin
};

std::unique_ptr<DirectIoBuffer> ReadBufferPool::Take() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) return std::make_unique<DirectIoBuffer>();
  std::unique_ptr<DirectIoBuffer> buffer = std::move(free_.back());
  free_.pop_back();
  return buffer;
}

void ReadBufferPool::Give(std::unique_ptr<DirectIoBuffer> buffer) {
  absl::MutexLock lock(&mu_);
  free_.push_back(std::move(buffer));
}

CheckpointReader::CheckpointReader(std::string dir, std::map<std::string, ManifestFile> files, ReadBufferPool& pool,
                                   ReaderOptions options)
    : dir_(std::move(dir)),
      files_(std::move(files)),
      pool_(pool),
      threads_(std::max(1, options.threads)),
      task_bytes_(options.task_bytes),
      cancelled_(std::move(options.cancelled)) {}

CheckpointReader::CheckpointReader(std::string where, std::map<std::string, ManifestFile> files, ReadBufferPool& pool,
                                   RemoteRead remote, ReaderOptions options)
    : CheckpointReader(std::move(where), std::move(files), pool, std::move(options)) {
  remote_ = std::move(remote);
}

CheckpointReader::~CheckpointReader() = default;

absl::StatusOr<CheckpointReader::OpenedFile*> CheckpointReader::Open(const std::string& file) {
  if (auto it = opened_.find(file); it != opened_.end()) return it->second.get();
  const auto listed = files_.find(file);
  if (listed == files_.end()) {
    return absl::DataLossError(absl::StrCat("the manifest of '", dir_, "' does not list '", file, "'"));
  }
  auto opened = std::make_unique<OpenedFile>();
  opened->name = file;
  opened->path = path(file);
  opened->manifest = &listed->second;
  if (remote_ != nullptr) return opened_.emplace(file, std::move(opened)).first->second.get();
  opened->fd = open(opened->path.c_str(), O_RDONLY | O_CLOEXEC);
  if (opened->fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("'", opened->path, "' is missing"));
    return ReadError(opened->path, err);
  }
  struct stat st {};
  if (fstat(opened->fd, &st) != 0) return ReadError(opened->path, errno);
  if (static_cast<uint64_t>(st.st_size) != listed->second.bytes) {
    return absl::DataLossError(absl::StrCat("'", opened->path, "' has ", st.st_size, " bytes; the manifest says ",
                                            listed->second.bytes, " (truncated?)"));
  }
  opened->direct_fd = open(opened->path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  return opened_.emplace(file, std::move(opened)).first->second.get();
}

namespace {

// Fills [begin, end) of `fd`'s file into `out` (= the byte at `begin`) with reads of
// `fd`; false with errno set on an error other than EAGAIN, and `*done` the bytes read.
// `nowait`: only what the page cache holds (stops at the first byte it lacks).
bool ReadSpan(int fd, std::byte* out, uint64_t begin, uint64_t end, bool nowait, uint64_t* done) {
  *done = 0;
  while (begin + *done < end) {
    iovec io{out + *done, static_cast<size_t>(end - begin - *done)};
    const ssize_t got = preadv2(fd, &io, 1, static_cast<off_t>(begin + *done), nowait ? RWF_NOWAIT : 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return nowait && (errno == EAGAIN || errno == EOPNOTSUPP);
    }
    if (got == 0) return true;
    *done += static_cast<uint64_t>(got);
  }
  return true;
}

}  // namespace

absl::Status CheckpointReader::Execute(const Task& task, DirectIoBuffer& buffer) const {
  const OpenedFile& file = *task.file;
  // buffer[0] holds the byte at `base`, so that O_DIRECT reads land aligned.
  const uint64_t base = AlignDown(task.begin);
  std::byte* data = buffer.Reserve(AlignUp(task.end) - base);
  // Extent by extent: read it (from the page cache while it has the bytes; once it lacks
  // some, the rest of the task at once, from the disk), verify it, deliver it while it is
  // still in the CPU's caches.
  uint64_t read_to = task.begin;
  bool cached = true;
  if (remote_ != nullptr) {  // the whole task at once, then verified extent by extent
    FLATSHARD_RETURN_IF_ERROR(remote_(file.name, task.begin, task.end - task.begin, data + (task.begin - base)));
    read_to = task.end;
    cached = false;
  }
  const std::vector<FileExtent>& extents = file.manifest->extents;
  // The requests come sorted by their first byte and the extents in order: those before
  // `first_open` end before the extent at hand, and an extent looks at the requests from
  // there to the first that begins past it (a file of 100000 small tensors has as many
  // extents and requests).
  const std::vector<const Request*>& requests = task.requests;
  size_t first_open = 0;
  for (size_t i = task.first_extent; i <= task.last_extent; ++i) {
    const FileExtent& e = extents[i];
    const uint64_t end = e.offset + e.length;
    while (first_open < requests.size() && requests[first_open]->end <= e.offset) ++first_open;
    const absl::Span<const Request* const> open = absl::MakeConstSpan(requests).subspan(first_open);
    // From the page cache straight into the destination where a single fp32 request
    // takes the whole extent, verified there: one copy fewer.
    if (cached && read_to <= e.offset) {
      const Request* whole = nullptr;
      int overlapping = 0;
      for (const Request* request : open) {
        if (request->begin >= end) break;
        if (request->end <= e.offset) continue;
        ++overlapping;
        if (request->dtype == DType::kFloat32 && request->begin <= e.offset && end <= request->end &&
            (e.offset - request->begin) % sizeof(float) == 0) {
          whole = request;
        }
      }
      if (whole != nullptr && overlapping == 1) {
        std::byte* out = reinterpret_cast<std::byte*>(whole->out) + (e.offset - whole->begin);
        uint64_t got = 0;
        if (!ReadSpan(file.fd, out, e.offset, end, /*nowait=*/true, &got)) return ReadError(file.path, errno);
        if (got == e.length) {
          if (Xxh3(absl::MakeConstSpan(out, e.length)) != e.xxh3) return CorruptExtent(file.path, e);
          if (progress_ != nullptr) progress_->done += e.length;
          read_to = end;
          continue;
        }
        cached = false;  // read again below, from the disk
        read_to = e.offset;
      }
    }
    if (read_to < end && cached) {
      uint64_t got = 0;
      if (!ReadSpan(file.fd, data + (read_to - base), read_to, end, /*nowait=*/true, &got)) {
        return ReadError(file.path, errno);
      }
      read_to += got;
      cached = read_to == end;
    }
    if (read_to < end) {
      uint64_t got = 0;
      const uint64_t from = AlignDown(read_to);
      if (file.direct_fd >= 0 &&
          ReadSpan(file.direct_fd, data + (from - base), from, AlignUp(task.end), false, &got)) {
        read_to = std::max(read_to, std::min(from + got, task.end));
      } else {
        if (file.direct_fd >= 0 && errno != EINVAL) return ReadError(file.path, errno);
        // O_DIRECT refused for this file system or these bounds: buffered reads.
        if (!ReadSpan(file.fd, data + (read_to - base), read_to, task.end, false, &got)) {
          return ReadError(file.path, errno);
        }
        read_to += got;
      }
      if (read_to < end) {
        return absl::DataLossError(absl::StrCat("'", file.path, "' ends at byte ", read_to,
                                                "; the manifest lists bytes up to ", task.end));
      }
    }
    if (Xxh3(absl::MakeConstSpan(data + (e.offset - base), e.length)) != e.xxh3) return CorruptExtent(file.path, e);
    for (const Request* request : open) {
      if (request->begin >= end) break;
      const uint64_t lo = std::max(request->begin, e.offset);
      const uint64_t hi = std::min(request->end, end);
      if (lo >= hi) continue;
      const uint64_t element = DTypeSize(request->dtype);
      if ((lo - request->begin) % element != 0 || (hi - request->begin) % element != 0) {
        return absl::DataLossError(absl::StrCat("'", file.path, "': the manifest's extents split elements of bytes [",
                                                request->begin, ", ", request->end, ")"));
      }
      FLATSHARD_RETURN_IF_ERROR(kernels::cpu::Cast(request->dtype, data + (lo - base), DType::kFloat32,
                                                   request->out + (lo - request->begin) / element,
                                                   static_cast<int64_t>((hi - lo) / element)));
      if (progress_ != nullptr) progress_->done += hi - lo;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::Add(const std::string& file, uint64_t offset, DType dtype, int64_t count, float* out) {
  FLATSHARD_ASSIGN_OR_RETURN(OpenedFile * opened, Open(file));
  const uint64_t bytes = opened->manifest->bytes;
  // Checked without wrapping around: `offset` and `count` come from the checkpoint's files.
  if (count < 0 || offset > bytes || static_cast<uint64_t>(count) > (bytes - offset) / DTypeSize(dtype)) {
    return absl::DataLossError(absl::StrCat("'", opened->path, "': ", count, " ", DTypeName(dtype),
                                            " elements at byte ", offset, " lie past its end (", bytes, " bytes)"));
  }
  const uint64_t end = offset + static_cast<uint64_t>(count) * DTypeSize(dtype);
  if (count > 0) requests_.push_back({opened, offset, end, dtype, out});
  return absl::OkStatus();
}

absl::Status CheckpointReader::Run(ProgressCounter* progress) {
  std::vector<Request> requests;
  requests.swap(requests_);
  progress_ = progress;
  if (progress_ != nullptr) {
    for (const Request& request : requests) progress_->total += request.end - request.begin;
  }
  std::sort(requests.begin(), requests.end(), [](const Request& a, const Request& b) {
    return a.file != b.file ? a.file < b.file : a.begin < b.begin;
  });
  // Per file, the extents the requests need, cut into runs of contiguous extents of at
  // most task_bytes_ (at least one extent each).
  std::vector<Task> tasks;
  for (const Request& request : requests) {
    const std::vector<FileExtent>& extents = request.file->manifest->extents;
    // The extent holding request.begin: the last one starting at or before it.
    size_t i = static_cast<size_t>(
        std::upper_bound(extents.begin(), extents.end(), request.begin,
                         [](uint64_t offset, const FileExtent& e) { return offset < e.offset; }) -
        extents.begin() - 1);
    for (; i < extents.size() && extents[i].offset < request.end; ++i) {
      Task* task = tasks.empty() ? nullptr : &tasks.back();
      const bool same = task != nullptr && task->file == request.file;
      if (same && i <= task->last_extent) {  // read for an earlier request already
        size_t t = tasks.size() - 1;
        while (tasks[t].first_extent > i) --t;  // requests are sorted: a task of this file holds i
        if (tasks[t].requests.back() != &request) tasks[t].requests.push_back(&request);
        continue;
      }
      const bool extend = same && i == task->last_extent + 1 &&
                          extents[i].offset + extents[i].length - task->begin <= task_bytes_;
      if (!extend) {
        tasks.push_back({request.file, i, i, extents[i].offset, extents[i].offset, {}});
        task = &tasks.back();
      }
      task->last_extent = i;
      task->end = extents[i].offset + extents[i].length;
      if (task->requests.empty() || task->requests.back() != &request) task->requests.push_back(&request);
    }
  }

  std::atomic<size_t> next{0};
  absl::Mutex mu;
  absl::Status first_error;
  auto work = [&] {
    std::unique_ptr<DirectIoBuffer> buffer = pool_.Take();
    for (size_t i = next++; i < tasks.size(); i = next++) {
      absl::Status status = cancelled_ && cancelled_() ? absl::CancelledError("the client that asked for it went away")
                                                       : Execute(tasks[i], *buffer);
      if (!status.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = std::move(status);
        next = tasks.size();
      }
    }
    pool_.Give(std::move(buffer));
  };
  std::vector<std::thread> threads;
  const size_t count = std::min<size_t>(static_cast<size_t>(threads_), tasks.size());
  for (size_t t = 1; t < count; ++t) threads.emplace_back(work);
  work();
  for (std::thread& thread : threads) thread.join();
  progress_ = nullptr;
  return first_error;
}

absl::StatusOr<std::string> CheckpointReader::ReadNow(const std::string& file, uint64_t offset, uint64_t length) {
  std::string bytes(length, '\0');
  FLATSHARD_ASSIGN_OR_RETURN(OpenedFile * opened, Open(file));
  if (offset + length > opened->manifest->bytes) {
    return absl::DataLossError(absl::StrCat("'", opened->path, "': bytes [", offset, ", ", offset + length,
                                            ") lie past its end (", opened->manifest->bytes, " bytes)"));
  }
  if (length == 0) return bytes;
  const std::vector<FileExtent>& extents = opened->manifest->extents;
  size_t first = static_cast<size_t>(
      std::upper_bound(extents.begin(), extents.end(), offset,
                       [](uint64_t at, const FileExtent& e) { return at < e.offset; }) -
      extents.begin() - 1);
  size_t last = first;
  while (last + 1 < extents.size() && extents[last + 1].offset < offset + length) ++last;
  Task task{opened, first, last, extents[first].offset, extents[last].offset + extents[last].length, {}};
  std::unique_ptr<DirectIoBuffer> buffer = pool_.Take();
  absl::Status read = Execute(task, *buffer);
  // Execute verified the task's bytes; they are still in the buffer.
  if (read.ok()) std::memcpy(bytes.data(), buffer->data() + (offset - AlignDown(task.begin)), length);
  pool_.Give(std::move(buffer));
  FLATSHARD_RETURN_IF_ERROR(read);
  return bytes;
}

absl::StatusOr<std::string> CheckpointReader::ReadWhole(const std::string& file) {
  FLATSHARD_ASSIGN_OR_RETURN(OpenedFile * opened, Open(file));
  return ReadNow(file, 0, opened->manifest->bytes);
}

absl::StatusOr<SafetensorsHeader> CheckpointReader::ReadHeader(const std::string& file) {
  FLATSHARD_ASSIGN_OR_RETURN(OpenedFile * opened, Open(file));
  const uint64_t size = opened->manifest->bytes;
  FLATSHARD_ASSIGN_OR_RETURN(const std::string prefix, ReadNow(file, 0, std::min<uint64_t>(8, size)));
  FLATSHARD_ASSIGN_OR_RETURN(const uint64_t header_size, SafetensorsHeader::HeaderSize(prefix, size, opened->path));
  FLATSHARD_ASSIGN_OR_RETURN(const std::string bytes, ReadNow(file, 0, header_size));
  return SafetensorsHeader::Parse(bytes, size, opened->path);
}

}  // namespace flatshard::server
