// The client's side of an import (Client::ImportCheckpoint): which files of a state dict
// in a directory of the caller's go to server 0, and their bytes on the ImportCheckpoint
// stream (proto/flatshard.proto, ImportMessage). FULL, for the model and, if asked, the
// optimizer: "<prefix>.safetensors.index.json" and the files its weight_map names where
// the index is there (a split state dict), else "<prefix>.safetensors". SHARDED (an
// export's): every "shard-<i>.safetensors". Other files in the directory stay out (an
// export's stale leftovers cannot be among them: an export removes them). Server 0
// checks what the files hold. Internal to the client library; functions only,
// thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto files, StateDictFiles(dir, /*optimizer=*/true));
//   FLATSHARD_RETURN_IF_ERROR(SendStateDictFiles(*writer, dir, files, 4 << 20, progress));
#ifndef FLATSHARD_CLIENT_IMPORT_FILES_H_
#define FLATSHARD_CLIENT_IMPORT_FILES_H_

#include <grpcpp/support/sync_stream.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatshard/client.h"
#include "proto/flatshard.pb.h"

namespace flatshard::client_internal {

struct StateDictFile {
  std::string name;  // in the directory
  uint64_t bytes = 0;
};

// The files an import of `dir` sends: FULL's model first, or SHARDED's by index (whose
// optimizer state is inside them whatever `optimizer` says). NotFound when `dir` holds
// neither model.safetensors nor model.safetensors.index.json nor shard files;
// InvalidArgument for an index that is not JSON with a "weight_map" of file names, or
// that names a file not in `dir`, or for a FULL state dict beside a SHARDED one.
[[nodiscard]] absl::StatusOr<std::vector<StateDictFile>> StateDictFiles(const std::string& dir, bool optimizer);

// Writes `files` of `dir` on `writer`, each opened with its size, in chunks of
// `chunk_bytes`, closed; `progress` (may be empty) after each chunk, with the bytes sent
// and the files' total. Unavailable when the stream no longer takes messages (the
// server ended it: its Finish says why); a read error names the file.
[[nodiscard]] absl::Status SendStateDictFiles(grpc::ClientWriter<v1::ImportMessage>& writer, const std::string& dir,
                                              const std::vector<StateDictFile>& files, uint32_t chunk_bytes,
                                              const Client::Progress& progress);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_IMPORT_FILES_H_
