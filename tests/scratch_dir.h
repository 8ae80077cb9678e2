// ScratchDir: a fresh, empty directory for one test under ::testing::TempDir(), removed
// with everything in it when the ScratchDir is destroyed (after a failed assertion
// too), so that repeated runs do not fill the disk with checkpoints, and no test leaves
// files behind. The name carries the process id: ctest runs tests in parallel. Not
// copyable; not thread-safe.
//
//   const testing::ScratchDir root("ckpt-async");
//   TestCluster cluster(2, "tok", ::testing::TempDir(), root.path());
#ifndef FLATSHARD_TESTS_SCRATCH_DIR_H_
#define FLATSHARD_TESTS_SCRATCH_DIR_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace flatshard::testing {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name)
      : path_(absl::StrCat(::testing::TempDir(), "/", name, "-", getpid())) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  const std::string path_;
};

// `name` inside a ScratchDir of this test process, removed when the process exits: for
// tests that each want a file or a directory of their own.
//
//   const std::string path = testing::ScratchPath("ok.safetensors");
inline std::string ScratchPath(const std::string& name) {
  static const ScratchDir dir("scratch");
  return absl::StrCat(dir.path(), "/", name);
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_SCRATCH_DIR_H_
