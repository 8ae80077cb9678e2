#include "server/checkpoint_sink.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard::server {

absl::Status DirectorySink::Open(const std::string& file, uint64_t size, bool exclusive) {
  if (file.empty() || file[0] == '.' || file.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint file '", file, "': not a plain file name"));
  }
  FLATSHARD_ASSIGN_OR_RETURN(DirectFileWriter opened, DirectFileWriter::Open(dir_ + "/" + file, size, exclusive));
  open_.insert_or_assign(file, std::move(opened));
  if (exclusive) extents_.erase(file);
  return absl::OkStatus();
}

absl::Status DirectorySink::Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) {
  const auto it = open_.find(file);
  if (it == open_.end()) return absl::InternalError(absl::StrCat("'", file, "' written before Open"));
  FLATSHARD_RETURN_IF_ERROR(it->second.Write(offset, data));
  if (!data.empty()) extents_[file].push_back({offset, data.size(), Xxh3(data)});
  return absl::OkStatus();
}

absl::Status DirectorySink::Close(const std::string& file) {
  const auto it = open_.find(file);
  if (it == open_.end()) return absl::InternalError(absl::StrCat("'", file, "' closed before Open"));
  const absl::Status synced = it->second.Close();
  open_.erase(it);
  return synced;
}

}  // namespace flatshard::server
