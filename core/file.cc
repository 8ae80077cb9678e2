#include "core/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard {
namespace {

absl::Status ErrnoError(absl::string_view what, const std::string& path, int err) {
  const std::string message = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EEXIST) return absl::AlreadyExistsError(message);
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) return absl::ResourceExhaustedError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

sigset_t OnlySigXfsz() {
  sigset_t xfsz;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  return xfsz;
}

}  // namespace

absl::StatusOr<File> File::Open(const std::string& path, Mode mode) {
  int flags = O_CLOEXEC;
  switch (mode) {
    case Mode::kRead:
      flags |= O_RDONLY;
      break;
    case Mode::kWrite:
      flags |= O_RDWR | O_CREAT;
      break;
    case Mode::kCreateNew:
      flags |= O_RDWR | O_CREAT | O_EXCL;
      break;
    case Mode::kWriteDirect:
      flags |= O_WRONLY | O_DIRECT;
      break;
  }
  const int fd = open(path.c_str(), flags, 0644);
  if (fd < 0) return ErrnoError("open", path, errno);
  return File(fd, path);
}

absl::StatusOr<File> File::OpenUnnamed(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const int fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
  if (fd >= 0) return File(fd, path);
  const int err = errno;
  // EISDIR: a kernel without O_TMPFILE; EOPNOTSUPP: a file system without it.
  if (err == EOPNOTSUPP || err == EISDIR || err == EINVAL) {
    return absl::UnimplementedError(absl::StrCat("cannot create an unnamed file in '", dir, "': ", std::strerror(err)));
  }
  return ErrnoError("create an unnamed file for", path, err);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) close(fd_);
}

absl::Status File::WriteAt(uint64_t offset, absl::Span<const std::byte> data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t wrote = pwrite(fd_, data.data() + done, data.size() - done,
                                 static_cast<off_t>(offset + done));
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write", path_, errno);
    }
    done += static_cast<size_t>(wrote);
  }
  return absl::OkStatus();
}

absl::Status File::ReadAt(uint64_t offset, absl::Span<std::byte> data) const {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t got = pread(fd_, data.data() + done, data.size() - done,
                              static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("read", path_, errno);
    }
    if (got == 0) {
      return absl::DataLossError(absl::StrCat("'", path_, "' is truncated: wanted ", data.size(),
                                              " bytes at offset ", offset, ", got ", done));
    }
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::Status File::Truncate(uint64_t size) {
  if (ftruncate(fd_, static_cast<off_t>(size)) != 0) return ErrnoError("truncate", path_, errno);
  return absl::OkStatus();
}

absl::Status File::Reserve(uint64_t size) {
  if (size > 0) {
    int result;
    do {
      result = fallocate(fd_, 0, 0, static_cast<off_t>(size));
    } while (result != 0 && errno == EINTR);
    if (result != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
      return ErrnoError(absl::StrCat("reserve ", size, " bytes for"), path_, errno);
    }
  }
  return Truncate(size);  // a longer file shrinks; fallocate keeps it
}

absl::Status File::CheckRoom(uint64_t size) const {
  rlimit limit{};
  if (getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY && size > limit.rlim_cur) {
    return ErrnoError(absl::StrCat(size, " bytes, past the file size limit of ", limit.rlim_cur, " bytes, for"), path_,
                      EFBIG);
  }
  struct stat st {};
  struct statvfs fs {};
  if (fstat(fd_, &st) != 0) return ErrnoError("stat", path_, errno);
  if (fstatvfs(fd_, &fs) != 0) return ErrnoError("statvfs", path_, errno);
  const uint64_t has = static_cast<uint64_t>(st.st_blocks) * 512;
  const uint64_t free = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  // A file system that reports no size (f_blocks 0, as some FUSE ones do) is not judged.
  if (fs.f_blocks > 0 && size > has && size - has > free) {
    return ErrnoError(absl::StrCat(size - has, " more bytes, with ", free, " free, for"), path_, ENOSPC);
  }
  return absl::OkStatus();
}

absl::Status File::Sync() {
  if (fsync(fd_) != 0) return ErrnoError("fsync", path_, errno);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> File::Size() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return ErrnoError("stat", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<bool> File::TryLock() {
  while (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return false;
    if (errno != EINTR) return ErrnoError("flock", path_, errno);
  }
  return true;
}

absl::Status File::Link() {
  const std::string self = absl::StrCat("/proc/self/fd/", fd_);
  int result = linkat(AT_FDCWD, self.c_str(), AT_FDCWD, path_.c_str(), AT_SYMLINK_FOLLOW);
  // Without /proc, linking the descriptor itself takes CAP_DAC_READ_SEARCH.
  if (result != 0 && errno == ENOENT && access("/proc/self/fd", F_OK) != 0) {
    result = linkat(fd_, "", AT_FDCWD, path_.c_str(), AT_EMPTY_PATH);
  }
  if (result != 0) return ErrnoError("link", path_, errno);
  return absl::OkStatus();
}

FileSizeLimitAsError::FileSizeLimitAsError() {
  const sigset_t xfsz = OnlySigXfsz();
  pthread_sigmask(SIG_BLOCK, &xfsz, &previous_);
}

FileSizeLimitAsError::~FileSizeLimitAsError() {
  const sigset_t xfsz = OnlySigXfsz();
  const timespec now{0, 0};
  // The kernel sends SIGXFSZ to the writing thread: pending here while blocked.
  while (sigtimedwait(&xfsz, nullptr, &now) == SIGXFSZ) {
  }
  pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
}

absl::Status SyncDirectory(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open directory", path, errno);
  const int result = fsync(fd);
  const int err = errno;
  close(fd);
  if (result != 0) return ErrnoError("fsync directory", path, err);
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string temporary = absl::StrCat(path, ".tmp-", getpid());
  absl::Status written = [&] {
    FLATSHARD_ASSIGN_OR_RETURN(File file, File::Open(temporary, File::Mode::kWrite));
    FLATSHARD_RETURN_IF_ERROR(file.Truncate(0));
    FLATSHARD_RETURN_IF_ERROR(file.WriteAt(
        0, absl::MakeConstSpan(reinterpret_cast<const std::byte*>(contents.data()), contents.size())));
    return file.Sync();
  }();
  if (written.ok() && rename(temporary.c_str(), path.c_str()) != 0) written = ErrnoError("rename", temporary, errno);
  if (!written.ok()) {
    unlink(temporary.c_str());  // a full disk keeps no half-written copy
    return written;
  }
  const size_t slash = path.rfind('/');
  return SyncDirectory(slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash));
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  FLATSHARD_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  FLATSHARD_ASSIGN_OR_RETURN(const uint64_t size, file.Size());
  std::string contents(size, '\0');
  FLATSHARD_RETURN_IF_ERROR(
      file.ReadAt(0, absl::MakeSpan(reinterpret_cast<std::byte*>(contents.data()), size)));
  return contents;
}

}  // namespace flatshard
