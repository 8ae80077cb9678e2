// File's errors when a write meets the process's file size limit (RLIMIT_FSIZE), with
// and without FileSizeLimitAsError.
#include "core/file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <csignal>
#include <filesystem>
#include <iterator>
#include <vector>

#include "tests/file_size_limit.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

constexpr rlim_t kLimit = 64 << 10;

absl::Span<const std::byte> AsBytes(absl::string_view text) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(text.data()), text.size());
}

absl::Status WritePastTheLimit(const std::string& path) {
  absl::StatusOr<File> file = File::Open(path, File::Mode::kWrite);
  if (!file.ok()) return file.status();
  const std::vector<std::byte> bytes(kLimit * 2);
  return file->WriteAt(0, bytes);
}

TEST(FileSizeLimitTest, AWritePastTheLimitKillsTheProcessByDefault) {
  const testing::ScratchDir dir("file-size-default");
  EXPECT_EXIT(
      {
        testing::ScopedFileSizeLimit limit(kLimit);
        (void)WritePastTheLimit(dir.path() + "/big");
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGXFSZ), "");
}

TEST(FileSizeLimitTest, UnderFileSizeLimitAsErrorItIsResourceExhaustedNamingTheFile) {
  const testing::ScratchDir dir("file-size-error");
  absl::Status written;
  {
    testing::ScopedFileSizeLimit limit(kLimit);
    const FileSizeLimitAsError as_error;
    written = WritePastTheLimit(dir.path() + "/big");
  }
  // Still alive: the SIGXFSZ it raised was discarded, not delivered when unblocked.
  EXPECT_TRUE(absl::IsResourceExhausted(written)) << written;
  EXPECT_THAT(std::string(written.message()), HasSubstr(dir.path() + "/big"));
  // The thread's signal mask is what it was: SIGXFSZ is not blocked any more.
  sigset_t mask;
  pthread_sigmask(SIG_SETMASK, nullptr, &mask);
  EXPECT_FALSE(sigismember(&mask, SIGXFSZ));
}

TEST(FileSizeLimitTest, AnAtomicWritePastTheLimitKeepsTheOldFileAndNoCopy) {
  const testing::ScratchDir dir("file-size-atomic");
  const std::string path = dir.path() + "/manifest.json";
  ASSERT_TRUE(WriteFileAtomically(path, "old").ok());
  absl::Status written;
  {
    testing::ScopedFileSizeLimit limit(kLimit);
    const FileSizeLimitAsError as_error;
    written = WriteFileAtomically(path, std::string(kLimit * 2, 'x'));
  }
  EXPECT_TRUE(absl::IsResourceExhausted(written)) << written;
  EXPECT_EQ(*ReadFileToString(path), "old");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()), 1);
}

TEST(FileTest, ReserveAllocatesTheFileAndFailsAtOnceWithoutRoom) {
  const testing::ScratchDir dir("file-reserve");
  auto file = File::Open(dir.path() + "/reserved", File::Mode::kWrite);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE(file->Reserve(1 << 20).ok());
  EXPECT_EQ(file->Size().value_or(0), uint64_t{1} << 20);
  struct stat st {};
  ASSERT_EQ(stat(file->path().c_str(), &st), 0);
  EXPECT_GE(st.st_blocks * 512, 1 << 20) << "the blocks are allocated, not a hole";
  ASSERT_TRUE(file->Reserve(4096).ok());  // a longer file shrinks
  EXPECT_EQ(file->Size().value_or(0), 4096u);

  absl::Status reserved;
  {
    testing::ScopedFileSizeLimit limit(kLimit);
    const FileSizeLimitAsError as_error;
    reserved = file->Reserve(kLimit * 2);
  }
  EXPECT_TRUE(absl::IsResourceExhausted(reserved)) << reserved;
  EXPECT_THAT(std::string(reserved.message()), HasSubstr("reserve"));
  EXPECT_EQ(file->Size().value_or(0), 4096u);
}

TEST(FileTest, CheckRoomRefusesAFilePastTheLimitOrTheFreeSpace) {
  const testing::ScratchDir dir("file-room");
  auto file = File::Open(dir.path() + "/checked", File::Mode::kWrite);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->CheckRoom(1 << 20).ok());
  struct statvfs fs {};
  ASSERT_EQ(statvfs(dir.path().c_str(), &fs), 0);
  const uint64_t free = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  const absl::Status no_room = file->CheckRoom(2 * free + (uint64_t{1} << 30));
  EXPECT_TRUE(absl::IsResourceExhausted(no_room)) << no_room;
  EXPECT_THAT(std::string(no_room.message()), HasSubstr("No space left"));
  testing::ScopedFileSizeLimit limit(kLimit);
  EXPECT_TRUE(file->CheckRoom(kLimit).ok());
  const absl::Status past_limit = file->CheckRoom(kLimit + 1);
  EXPECT_TRUE(absl::IsResourceExhausted(past_limit)) << past_limit;
  EXPECT_THAT(std::string(past_limit.message()), HasSubstr("file size limit"));
  EXPECT_EQ(file->Size().value_or(1), 0u);  // checked, not grown
}

TEST(FileTest, TryLockHoldsTheFileAgainstOtherOpensUntilItCloses) {
  const testing::ScratchDir dir("file-lock");
  const std::string path = dir.path() + "/locked";
  ASSERT_TRUE(WriteFileAtomically(path, "x").ok());
  auto holder = File::Open(path, File::Mode::kRead);
  auto other = File::Open(path, File::Mode::kWrite);
  ASSERT_TRUE(holder.ok() && other.ok());
  EXPECT_EQ(holder->TryLock().value_or(false), true);
  EXPECT_EQ(other->TryLock().value_or(true), false);  // another open, even in this process
  holder = absl::NotFoundError("closed");
  EXPECT_EQ(other->TryLock().value_or(false), true);
}

TEST(FileTest, AnUnnamedFileTakesItsNameAtLinkAndVanishesWithoutIt) {
  const testing::ScratchDir dir("file-unnamed");
  const std::string path = dir.path() + "/named-at-link";
  auto file = File::OpenUnnamed(path);
  ASSERT_TRUE(file.ok()) << file.status();  // ext4 and tmpfs make unnamed files
  ASSERT_TRUE(file->WriteAt(0, AsBytes("whole")).ok());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  ASSERT_TRUE(file->Link().ok());
  EXPECT_EQ(ReadFileToString(path).value_or(""), "whole");

  // A name that is taken stays as it was; a file never linked leaves nothing.
  auto other = File::OpenUnnamed(path);
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE(other->WriteAt(0, AsBytes("other")).ok());
  const absl::Status taken = other->Link();
  EXPECT_TRUE(absl::IsAlreadyExists(taken)) << taken;
  other = absl::NotFoundError("closed");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()), 1);
  EXPECT_EQ(ReadFileToString(path).value_or(""), "whole");
}

TEST(FileTest, AnUnnamedFileInADirectoryThatIsMissingIsNotFound) {
  const testing::ScratchDir dir("file-unnamed-missing");
  const absl::StatusOr<File> file = File::OpenUnnamed(dir.path() + "/missing/file");
  EXPECT_TRUE(absl::IsNotFound(file.status())) << file.status();
}

}  // namespace
}  // namespace flatshard
