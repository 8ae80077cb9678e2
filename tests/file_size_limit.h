// ScopedFileSizeLimit: lowers this process's soft file size limit (RLIMIT_FSIZE) to
// `bytes` while it lives, standing in for a full disk: writes past it fail with EFBIG
// (under FileSizeLimitAsError or where SIGXFSZ is ignored; otherwise SIGXFSZ kills the
// process). Child processes started meanwhile keep the limit. Not thread-safe: the limit
// is the whole process's.
//
//   { const testing::ScopedFileSizeLimit limit(1 << 20); cluster.Restart(1); }
#ifndef FLATSHARD_TESTS_FILE_SIZE_LIMIT_H_
#define FLATSHARD_TESTS_FILE_SIZE_LIMIT_H_

#include <sys/resource.h>

namespace flatshard::testing {

class ScopedFileSizeLimit {
 public:
  explicit ScopedFileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &previous_);
    rlimit lowered = previous_;
    lowered.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &lowered);
  }
  ~ScopedFileSizeLimit() { setrlimit(RLIMIT_FSIZE, &previous_); }
  ScopedFileSizeLimit(const ScopedFileSizeLimit&) = delete;
  ScopedFileSizeLimit& operator=(const ScopedFileSizeLimit&) = delete;

 private:
  rlimit previous_{};
};

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_FILE_SIZE_LIMIT_H_
