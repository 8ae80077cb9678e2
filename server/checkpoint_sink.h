// CheckpointSink: where a server's checkpoint bytes go: files in a checkpoint directory
// (DirectorySink, for save), a stream to server 0 for a part kept in its root
// (PeerPartWriter, server/peer_client.h) or to a remote client (StreamSink in
// server/service.cc, for export). The writers in checkpoint_writer.cc produce the same
// files either way, in bounded slices. One writer per sink; not thread-safe.
//
//   DirectorySink sink(dir);
//   FLATSHARD_RETURN_IF_ERROR(sink.Open("model.safetensors", size, /*exclusive=*/false));
//   FLATSHARD_RETURN_IF_ERROR(sink.Write("model.safetensors", offset, bytes));
//   FLATSHARD_RETURN_IF_ERROR(sink.Close("model.safetensors"));
#ifndef FLATSHARD_SERVER_CHECKPOINT_SINK_H_
#define FLATSHARD_SERVER_CHECKPOINT_SINK_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/direct_io.h"
#include "server/file_extents.h"

namespace flatshard::server {

// Checkpoint names, and the names of their files: one path component of 1-128
// characters of [A-Za-z0-9._-], not starting with '.'. InvalidArgument naming `what`
// otherwise.
[[nodiscard]] absl::Status ValidateCheckpointName(const std::string& name,
                                                  absl::string_view what = "checkpoint name");

class CheckpointSink {
 public:
  virtual ~CheckpointSink() = default;
  // Starts `file` of final size `size`. `exclusive`: this writer alone writes it (old
  // contents are dropped); otherwise several servers fill their own ranges of it.
  [[nodiscard]] virtual absl::Status Open(const std::string& file, uint64_t size, bool exclusive) = 0;
  [[nodiscard]] virtual absl::Status Write(const std::string& file, uint64_t offset,
                                           absl::Span<const std::byte> data) = 0;
  // The file is complete from this writer's side (durable, for files on disk).
  [[nodiscard]] virtual absl::Status Close(const std::string& file) = 0;
};

// Files directly under `dir` (a name ValidateCheckpointName refuses is InvalidArgument;
// so are a size no file can have, a write past the file's size or to a file not open: the
// bytes may come from a peer, WriteCheckpointPart), written through DirectFileWriter
// (O_DIRECT for whole pages, the page cache for the partial pages other servers share)
// and fsync'd on Close. Every write is hashed as it is written: extents() are this
// writer's (offset, length, XXH3) per file, for the manifest, so that no one re-reads the
// files to checksum them. A write that continues the file's last extent joins it while
// the extent stays within kMaxExtentBytes: a shard of 100000 small tensors is a few
// extents, not one per tensor (each costs manifest bytes and a check at load), and a
// load reads at most that many bytes it does not need at either end of a range.
class DirectorySink final : public CheckpointSink {
 public:
  static constexpr uint64_t kMaxExtentBytes = uint64_t{4} << 20;

  explicit DirectorySink(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Open(const std::string& file, uint64_t size, bool exclusive) override;
  absl::Status Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) override;
  absl::Status Close(const std::string& file) override;

  const std::map<std::string, std::vector<FileExtent>>& extents() const { return extents_; }

 private:
  const std::string dir_;
  struct OpenFile {
    DirectFileWriter writer;
    uint64_t size = 0;
    // Hashes the file's last extent while writes extend it (false: that extent was
    // written before this Open, its bytes are not in `tail`).
    bool extending = false;
    Xxh3Stream tail;
  };
  std::map<std::string, OpenFile> open_;
  std::map<std::string, std::vector<FileExtent>> extents_;
};

// Forwards to `sink` until `cancelled()` (asked before every call) says true; from then
// on every call is Cancelled, so that a writer stops within one slice once the caller
// that asked for the bytes has gone. An empty `cancelled` never cancels. `sink` must
// outlive this.
class CancellableSink final : public CheckpointSink {
 public:
  CancellableSink(CheckpointSink& sink, std::function<bool()> cancelled)
      : sink_(sink), cancelled_(std::move(cancelled)) {}
  absl::Status Open(const std::string& file, uint64_t size, bool exclusive) override;
  absl::Status Write(const std::string& file, uint64_t offset, absl::Span<const std::byte> data) override;
  absl::Status Close(const std::string& file) override;

 private:
  absl::Status Check() const;

  CheckpointSink& sink_;
  const std::function<bool()> cancelled_;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CHECKPOINT_SINK_H_
