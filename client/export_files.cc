#include "client/export_files.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/state_dict_files.h"
#include "core/status_macros.h"

namespace flatshard::client_internal {
namespace {

// A temporary file is ".<file>" + kPartial + its export's id, 16 hex digits.
constexpr absl::string_view kPartial = ".partial-";
constexpr size_t kExportIdDigits = 16;

std::string NewExportId() {
  std::random_device random;
  return absl::StrFormat("%08x%08x", random(), random());
}

bool AllChars(absl::string_view text, int (*is)(int)) {
  return std::all_of(text.begin(), text.end(), [is](char c) { return is(static_cast<unsigned char>(c)) != 0; });
}

// The names an export gives its files (server/checkpoint_writer.cc): FULL's model and
// optimizer files (core/state_dict_files.h), and SHARDED's file per server
// ("shard-3.safetensors").
bool IsExportFileName(absl::string_view name) {
  return IsShardFileName(name) || IsStateDictFileName(name);
}

// Whether `name` is an export's temporary file.
bool IsTemporaryFileName(absl::string_view name) {
  const size_t partial = name.rfind(kPartial);
  if (name.empty() || name[0] != '.' || partial == absl::string_view::npos || partial < 2) return false;
  const absl::string_view id = name.substr(partial + kPartial.size());
  return id.size() == kExportIdDigits && AllChars(id, isxdigit);
}

}  // namespace

ExportFiles::ExportFiles(std::string out_dir, Temporaries temporaries)
    : out_dir_(std::move(out_dir)),
      suffix_(absl::StrCat(kPartial, NewExportId())),
      unnamed_(temporaries == Temporaries::kUnnamedWherePossible) {}

ExportFiles::~ExportFiles() {
  absl::MutexLock lock(&mu_);
  // Removed while still locked: the files close after. Unnamed ones vanish as they close.
  for (const auto& [name, temporary] : files_) {
    if (temporary.named) std::remove(TemporaryPath(name).c_str());
  }
}

std::string ExportFiles::TemporaryPath(const std::string& file) const {
  return absl::StrCat(out_dir_, "/.", file, suffix_);
}

absl::StatusOr<File*> ExportFiles::FileFor(const v1::ExportChunk& chunk) {
  const std::string& name = chunk.file();
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') {
    return absl::DataLossError(absl::StrCat("export: the server named a file '", name, "'"));
  }
  absl::MutexLock lock(&mu_);
  if (auto it = files_.find(name); it != files_.end()) return &it->second.file;
  const std::string path = TemporaryPath(name);
  absl::StatusOr<File> file = absl::UnimplementedError("");
  if (unnamed_) file = File::OpenUnnamed(path);
  if (absl::IsUnimplemented(file.status())) {
    unnamed_ = false;
    file = File::Open(path, File::Mode::kWrite);
  }
  if (!file.ok()) return file.status();
  const absl::StatusOr<bool> locked = file->TryLock();
  absl::Status ready = locked.status();
  if (ready.ok() && !*locked) ready = absl::InternalError(absl::StrCat("'", path, "' is locked by another process"));
  if (ready.ok()) ready = file->Reserve(chunk.file_size());
  if (!ready.ok()) {
    // Gone, so that the next stream to write the file tries anew rather than write into
    // one without room.
    if (!unnamed_) std::remove(path.c_str());
    return ready;
  }
  return &files_.emplace(name, Temporary{*std::move(file), !unnamed_}).first->second.file;
}

absl::Status ExportFiles::WriteChunk(const v1::ExportChunk& chunk) {
  FLATSHARD_ASSIGN_OR_RETURN(File* const file, FileFor(chunk));
  if (!chunk.data().empty()) {
    FLATSHARD_RETURN_IF_ERROR(file->WriteAt(
        chunk.offset(),
        absl::MakeConstSpan(reinterpret_cast<const std::byte*>(chunk.data().data()), chunk.data().size())));
  }
  if (chunk.close()) FLATSHARD_RETURN_IF_ERROR(file->Sync());
  return absl::OkStatus();
}

absl::Status ExportFiles::Publish() {
  absl::MutexLock lock(&mu_);
  // An index names the other files: it takes its name only once they have theirs.
  std::vector<std::string> order;
  for (const auto& [file, temporary] : files_) {
    if (!absl::EndsWith(file, ".json")) order.push_back(file);
  }
  for (const auto& [file, temporary] : files_) {
    if (absl::EndsWith(file, ".json")) order.push_back(file);
  }
  for (const std::string& file : order) {
    Temporary& temporary = files_.at(file);
    if (!temporary.named) {
      FLATSHARD_RETURN_IF_ERROR(temporary.file.Link());
      temporary.named = true;
    }
    const std::string from = TemporaryPath(file), to = absl::StrCat(out_dir_, "/", file);
    if (std::rename(from.c_str(), to.c_str()) != 0) {
      const int err = errno;
      return absl::InternalError(absl::StrCat("cannot rename '", from, "' to '", to, "': ", std::strerror(err)));
    }
    files_.erase(file);  // no longer the export's to remove
  }
  const absl::Status removed = RemoveStaleFiles(order);
  FLATSHARD_RETURN_IF_ERROR(SyncDirectory(out_dir_));
  return removed;
}

absl::Status ExportFiles::RemoveStaleFiles(const std::vector<std::string>& published) const {
  namespace fs = std::filesystem;
  const fs::file_time_type written_before = fs::file_time_type::clock::now() - absl::ToChronoSeconds(kAbandonedAfter);
  std::error_code error;
  for (fs::directory_iterator it(out_dir_, error); !error && it != fs::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename();
    std::error_code ignored;
    if (IsExportFileName(name)) {  // the earlier export's, unless this one wrote it
      if (!it->is_directory(error) && std::find(published.begin(), published.end(), name) == published.end() &&
          !fs::remove(it->path(), error) && error) {
        break;
      }
    } else if (IsTemporaryFileName(name) && !absl::EndsWith(name, suffix_) && it->is_regular_file(ignored) &&
               it->last_write_time(ignored) <= written_before) {  // maybe a dead export's: best effort
      absl::StatusOr<File> file = File::Open(it->path(), File::Mode::kRead);
      if (file.ok() && file->TryLock().value_or(false)) fs::remove(it->path(), ignored);
    }
  }
  if (error) {
    return absl::InternalError(
        absl::StrCat("the export is in '", out_dir_,
                     "', but an earlier export's files there could not be removed: ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace flatshard::client_internal
