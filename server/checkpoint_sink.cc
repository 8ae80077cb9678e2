#include "server/checkpoint_sink.h"

#include <sys/types.h>

#include <algorithm>
#include <cctype>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard::server {

absl::Status ValidateCheckpointName(const std::string& name, absl::string_view what) {
  const bool ok = !name.empty() && name.size() <= 128 && name[0] != '.' &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
                  });
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", name, "': use 1-128 characters of [A-Za-z0-9._-], not starting with "
        "'.' (names are confined to the server's --checkpoint_root)"));
  }
  return absl::OkStatus();
}

absl::Status DirectorySink::Open(const std::string& file, uint64_t size, bool exclusive) {
  FLATSHARD_RETURN_IF_ERROR(ValidateCheckpointName(file, "checkpoint file"));
  if (size > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint file '", file, "': ", size, " bytes is beyond any file's size"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(DirectFileWriter opened, DirectFileWriter::Open(dir_ + "/" + file, size, exclusive));
  open_.insert_or_assign(file, OpenFile{std::move(opened), size, false, Xxh3Stream()});
  if (exclusive) extents_.erase(file);
  return absl::OkStatus();
}

absl::Status DirectorySink::Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) {
  const auto it = open_.find(file);
  if (it == open_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint file '", file, "' written before it was opened"));
  }
  if (offset > it->second.size || data.size() > it->second.size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint file '", file, "': ", data.size(),
                                                   " bytes at offset ", offset, " run past its ",
                                                   it->second.size, " bytes"));
  }
  OpenFile& open = it->second;
  FLATSHARD_RETURN_IF_ERROR(open.writer.Write(offset, data));
  if (data.empty()) return absl::OkStatus();
  std::vector<FileExtent>& extents = extents_[file];
  if (open.extending && extents.back().offset + extents.back().length == offset &&
      extents.back().length + data.size() <= kMaxExtentBytes) {
    open.tail.Update(data);
    extents.back().length += data.size();
    extents.back().xxh3 = open.tail.Digest();
    return absl::OkStatus();
  }
  open.tail.Reset();
  open.tail.Update(data);
  extents.push_back({offset, data.size(), open.tail.Digest()});
  open.extending = true;
  return absl::OkStatus();
}

absl::Status DirectorySink::Close(const std::string& file) {
  const auto it = open_.find(file);
  if (it == open_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint file '", file, "' closed before it was opened"));
  }
  const absl::Status synced = it->second.writer.Close();
  open_.erase(it);
  return synced;
}

absl::Status CancellableSink::Check() const {
  if (cancelled_ && cancelled_()) return absl::CancelledError("the client that asked for it went away");
  return absl::OkStatus();
}

absl::Status CancellableSink::Open(const std::string& file, uint64_t size, bool exclusive) {
  FLATSHARD_RETURN_IF_ERROR(Check());
  return sink_.Open(file, size, exclusive);
}

absl::Status CancellableSink::Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) {
  FLATSHARD_RETURN_IF_ERROR(Check());
  return sink_.Write(file, offset, data);
}

absl::Status CancellableSink::Close(const std::string& file) {
  FLATSHARD_RETURN_IF_ERROR(Check());
  return sink_.Close(file);
}

}  // namespace flatshard::server
