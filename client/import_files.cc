#include "client/import_files.h"

#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/file.h"
#include "core/state_dict_files.h"
#include "core/status_macros.h"

namespace flatshard::client_internal {
namespace {

namespace fs = std::filesystem;

// `dir`/`name` as a file to send; NotFound if it is not a regular file.
absl::StatusOr<StateDictFile> Regular(const std::string& dir, const std::string& name) {
  std::error_code error;
  const fs::path path = fs::path(dir) / name;
  if (!fs::is_regular_file(path, error)) {
    return absl::NotFoundError(absl::StrCat("'", path.string(), "' is not there (or not a regular file)"));
  }
  const uintmax_t bytes = fs::file_size(path, error);
  if (error) {
    return absl::InternalError(absl::StrCat("cannot read the size of '", path.string(), "': ", error.message()));
  }
  return StateDictFile{name, static_cast<uint64_t>(bytes)};
}

// `prefix`'s files in `dir`, appended to `files`; false if there are none.
absl::StatusOr<bool> AddPrefix(const std::string& dir, const std::string& prefix, std::vector<StateDictFile>& files) {
  const std::string single = prefix + ".safetensors";
  const std::string index = single + ".index.json";
  absl::StatusOr<StateDictFile> index_file = Regular(dir, index);
  if (!index_file.ok()) {
    absl::StatusOr<StateDictFile> file = Regular(dir, single);
    if (!file.ok()) return false;
    files.push_back(*std::move(file));
    return true;
  }
  FLATSHARD_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(dir + "/" + index));
  FLATSHARD_ASSIGN_OR_RETURN(const auto weight_map, ParseWeightMap(text, dir + "/" + index));
  std::set<std::string> mapped;
  for (const auto& [tensor, file] : weight_map) mapped.insert(file);
  for (const std::string& name : mapped) {
    if (name.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", dir, "/", index, "' names '", name, "', not a file beside it"));
    }
    absl::StatusOr<StateDictFile> file = Regular(dir, name);
    if (!file.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", index, "' maps tensors to '", name, "': ", file.status().message()));
    }
    files.push_back(*std::move(file));
  }
  files.push_back(*std::move(index_file));
  return true;
}

// A SHARDED export's files in `dir`, by shard index.
absl::StatusOr<std::vector<StateDictFile>> ShardFiles(const std::string& dir) {
  std::map<int, StateDictFile> shards;
  std::error_code error;
  for (fs::directory_iterator entry(dir, error), end; !error && entry != end; entry.increment(error)) {
    int index = 0;
    const std::string name = entry->path().filename().string();
    if (!IsShardFileName(name, &index)) continue;
    FLATSHARD_ASSIGN_OR_RETURN(shards[index], Regular(dir, name));
  }
  if (error) return absl::NotFoundError(absl::StrCat("cannot list '", dir, "': ", error.message()));
  std::vector<StateDictFile> files;
  for (auto& [index, file] : shards) files.push_back(std::move(file));
  return files;
}

}  // namespace

absl::StatusOr<std::vector<StateDictFile>> StateDictFiles(const std::string& dir, bool optimizer) {
  std::vector<StateDictFile> files;
  FLATSHARD_ASSIGN_OR_RETURN(const bool model, AddPrefix(dir, "model", files));
  FLATSHARD_ASSIGN_OR_RETURN(std::vector<StateDictFile> shards, ShardFiles(dir));
  if (model && !shards.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", dir, "' holds a FULL state dict (", files.front().name,
                                                   ") and a SHARDED one (", shards.front().name,
                                                   "): import one directory per state dict"));
  }
  if (!shards.empty()) return shards;  // their optimizer state inside: server 0 leaves it out if asked
  if (!model) {
    return absl::NotFoundError(absl::StrCat("'", dir, "' holds no model.safetensors (nor model.safetensors.index.json)",
                                            " nor shard-<i>.safetensors to import"));
  }
  if (optimizer) FLATSHARD_RETURN_IF_ERROR(AddPrefix(dir, "optimizer", files).status());
  return files;
}

absl::Status SendStateDictFiles(grpc::ClientWriter<v1::ImportMessage>& writer, const std::string& dir,
                                const std::vector<StateDictFile>& files, uint32_t chunk_bytes,
                                const Client::Progress& progress) {
  uint64_t total = 0;
  for (const StateDictFile& file : files) total += file.bytes;
  const absl::Status ended = absl::UnavailableError("server 0 ended the import stream");
  std::string buffer(chunk_bytes, '\0');
  uint64_t done = 0;
  for (const StateDictFile& file : files) {
    FLATSHARD_ASSIGN_OR_RETURN(const File opened, File::Open(dir + "/" + file.name, File::Mode::kRead));
    uint64_t offset = 0;
    do {  // an empty file still goes: opened and closed
      const uint64_t length = std::min<uint64_t>(chunk_bytes, file.bytes - offset);
      FLATSHARD_RETURN_IF_ERROR(
          opened.ReadAt(offset, absl::MakeSpan(reinterpret_cast<std::byte*>(buffer.data()), length)));
      v1::ImportMessage message;
      v1::ExportChunk& chunk = *message.mutable_chunk();
      chunk.set_file(file.name);
      chunk.set_offset(offset);
      chunk.set_data(buffer.data(), length);
      if (offset == 0) {
        message.set_open(true);
        chunk.set_file_size(file.bytes);
      }
      offset += length;
      chunk.set_close(offset == file.bytes);
      if (!writer.Write(message)) return ended;
      done += length;
      if (progress) progress(done, total);
    } while (offset < file.bytes);
  }
  return absl::OkStatus();
}

}  // namespace flatshard::client_internal
