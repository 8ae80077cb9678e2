// ExportFiles: the files of one state-dict export into a directory of the caller's. The
// servers' streams write them under temporary names (".<file>.partial-<export id>", which
// no server may name: WriteChunk refuses names that start with a dot); Publish renames
// them to their own names once every stream has succeeded, index files last, so a file
// under its own name is always whole. An export that fails, or is destroyed before
// Publish, removes what it wrote and leaves earlier files of those names as they were
// (a Publish that fails part-way keeps the files it renamed, each whole). A process
// killed mid-export leaves only its dot-files; the next export into the directory that
// succeeds removes them. An export holds a lock (flock) on each of its temporary files
// until it ends, so that another can tell a dead export's files (unlocked, and untouched
// for kAbandonedAfter) from a running one's.
//
// An export replaces the earlier one in its directory: once its files have their names,
// Publish removes every other file named as an export names its files (model and
// optimizer files, split or not, their indexes, shard-<rank> files), so that a reader
// never takes a stale model.safetensors beside a model split into several files, or
// shard-3 of a 4-server export for part of a 2-server one. Other files stay.
//
// Thread-safe: each server's stream calls WriteChunk from a thread of its own, with its
// own `open` map; Publish and the destructor run once those threads are done.
//
//   ExportFiles files(out_dir);
//   ... per stream: FLATSHARD_RETURN_IF_ERROR(files.WriteChunk(message.chunk(), open));
//   FLATSHARD_RETURN_IF_ERROR(files.Publish());
#ifndef FLATSHARD_CLIENT_EXPORT_FILES_H_
#define FLATSHARD_CLIENT_EXPORT_FILES_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/file.h"
#include "proto/flatshard.pb.h"

namespace flatshard::client_internal {

class ExportFiles {
 public:
  // `out_dir` must exist.
  explicit ExportFiles(std::string out_dir);
  ~ExportFiles();  // removes the temporary files, unless published
  ExportFiles(const ExportFiles&) = delete;
  ExportFiles& operator=(const ExportFiles&) = delete;

  // One chunk of a stream: announces, fills or closes (fsyncs) a file. `open` holds the
  // stream's open files. DataLoss for a file name that is not a plain name in the
  // directory; the file's errors (ResourceExhausted when the disk or the process's file
  // size limit is full) otherwise.
  [[nodiscard]] absl::Status WriteChunk(const v1::ExportChunk& chunk, std::map<std::string, File>& open);

  // Renames every file written into place (index files last), removes the earlier
  // export's other files and dead exports' temporary files, and fsyncs the directory.
  // Call once, when every stream has succeeded.
  [[nodiscard]] absl::Status Publish();

  // How long another export's temporary file must have gone unwritten, besides unlocked,
  // before Publish takes it for a dead export's: covers the moment between a running
  // export creating a file and locking it.
  static constexpr absl::Duration kAbandonedAfter = absl::Minutes(1);

 private:
  std::string TemporaryPath(const std::string& file) const;
  // Removes, in one pass over out_dir_, the files of an export's names but `published`
  // (their errors are returned) and other exports' temporary files that no live export
  // holds (best effort).
  [[nodiscard]] absl::Status RemoveStaleFiles(const std::vector<std::string>& published) const;

  const std::string out_dir_;
  const std::string suffix_;  // ".partial-<export id>"
  absl::Mutex mu_;
  std::set<std::string> written_ ABSL_GUARDED_BY(mu_);  // files begun, by name
  // A locked open of each temporary file, until the export ends.
  std::map<std::string, File> locks_ ABSL_GUARDED_BY(mu_);
  bool published_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_EXPORT_FILES_H_
