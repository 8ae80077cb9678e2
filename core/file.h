// File: a POSIX file descriptor with positional, complete reads and writes, for
// checkpoint files that several writers fill at their own byte ranges. Errors are
// values naming the path. Not copyable; one File may be used from several threads for
// disjoint ranges (pread/pwrite are positional).
//
//   FLATSHARD_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kWrite));
//   FLATSHARD_RETURN_IF_ERROR(file.WriteAt(offset, bytes));
//   FLATSHARD_RETURN_IF_ERROR(file.Sync());
#ifndef FLATSHARD_CORE_FILE_H_
#define FLATSHARD_CORE_FILE_H_

#include <signal.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace flatshard {

class File {
 public:
  enum class Mode {
    kRead,         // existing file, read-only
    kWrite,        // create if missing, keep contents (several writers, own ranges)
    kCreateNew,    // create; AlreadyExists if it exists
    kWriteDirect,  // existing file, O_DIRECT (core/direct_io.h); fails where unsupported
  };

  [[nodiscard]] static absl::StatusOr<File> Open(const std::string& path, Mode mode);
  // Creates a file with no name yet (O_TMPFILE) in the directory of `path`, read-write:
  // it takes the name `path` at Link, and vanishes with its last open if it never does,
  // even when its process is killed. Unimplemented where the file system (NFS, most
  // FUSE ones) or the kernel cannot make unnamed files.
  [[nodiscard]] static absl::StatusOr<File> OpenUnnamed(const std::string& path);
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  // Writes all of `data` at `offset`. Internal / ResourceExhausted (disk full) naming the path.
  [[nodiscard]] absl::Status WriteAt(uint64_t offset, absl::Span<const std::byte> data);
  // Fills `data` from `offset`. DataLoss naming the path if the file ends first.
  [[nodiscard]] absl::Status ReadAt(uint64_t offset, absl::Span<std::byte> data) const;
  [[nodiscard]] absl::Status Truncate(uint64_t size);
  // Makes the file `size` bytes long, as Truncate does, with the blocks of those bytes
  // allocated (fallocate) where the file system can, so that a disk without room for the
  // file fails here, ResourceExhausted, and not after most of it has been written. Where
  // it cannot allocate ahead (EOPNOTSUPP, ENOSYS), only sets the size.
  [[nodiscard]] absl::Status Reserve(uint64_t size);
  // ResourceExhausted when the file, grown to `size` bytes, would not fit: past the
  // process's file size limit (ulimit -f), or more than the file system's free space
  // beyond the blocks the file already has. Takes nothing (another writer may fill the
  // disk first): for files several processes fill, which Reserve would slow.
  [[nodiscard]] absl::Status CheckRoom(uint64_t size) const;
  [[nodiscard]] absl::Status Sync();
  [[nodiscard]] absl::StatusOr<uint64_t> Size() const;
  // Takes an exclusive advisory lock (flock) on the file, held until this File closes
  // (or its process dies); false, without waiting, while another open of the file holds
  // one.
  [[nodiscard]] absl::StatusOr<bool> TryLock();
  // Gives a file from OpenUnnamed its name, path(). AlreadyExists if that name is taken.
  [[nodiscard]] absl::Status Link();
  const std::string& path() const { return path_; }

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// While it lives, this thread's writes past the process's file size limit (RLIMIT_FSIZE,
// `ulimit -f`) fail with EFBIG, which File reports as ResourceExhausted, instead of
// raising SIGXFSZ, whose default action kills the whole process. For library code that
// writes files on its own or its caller's threads (a program may just ignore SIGXFSZ).
// Not movable; destroy it on the thread that made it.
class FileSizeLimitAsError {
 public:
  FileSizeLimitAsError();
  ~FileSizeLimitAsError();  // discards a SIGXFSZ the writes raised, restores the mask
  FileSizeLimitAsError(const FileSizeLimitAsError&) = delete;
  FileSizeLimitAsError& operator=(const FileSizeLimitAsError&) = delete;

 private:
  sigset_t previous_;
};

// Writes `contents` to `path` atomically: a temporary file beside it, fsync, rename,
// fsync of the directory. The old file (if any) stays whole until the rename.
[[nodiscard]] absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// The whole file as a string; NotFound / Internal naming the path.
[[nodiscard]] absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// fsync of a directory (after renames inside it).
[[nodiscard]] absl::Status SyncDirectory(const std::string& path);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_FILE_H_
