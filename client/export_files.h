// ExportFiles: the files of one state-dict export into a directory of the caller's. The
// servers' streams write each file, through one open of it, as a file with no name
// (O_TMPFILE), which vanishes with the process if the export never ends: a client killed
// mid-export (Ctrl-C, SIGKILL, out of memory) leaves nothing behind. Publish, once every
// stream has succeeded, names each file ".<file>.partial-<export id>" (a name no server
// may give: WriteChunk refuses names that start with a dot) and renames it to its own
// name, index files last, so a file under its own name is always whole. An export that
// fails, or is destroyed before Publish, removes what it wrote and leaves earlier files
// of those names as they were (a Publish that fails part-way keeps the files it renamed,
// each whole).
//
// Where the directory's file system cannot make unnamed files (NFS, most FUSE ones), or
// with Temporaries::kNamed, each file is created under its temporary name instead. Then a
// killed process leaves those dot-files, and the next export into the directory that
// succeeds removes them: an export holds a lock (flock) on each of its temporary files
// until it ends, so that another can tell a dead export's files (unlocked, and untouched
// for kAbandonedAfter) from a running one's.
//
// An export replaces the earlier one in its directory: once its files have their names,
// Publish removes every other file named as an export names its files (model and
// optimizer files, split or not, their indexes, shard-<rank> files), so that a reader
// never takes a stale model.safetensors beside a model split into several files, or
// shard-3 of a 4-server export for part of a 2-server one. Other files stay.
//
// Thread-safe: each server's stream calls WriteChunk from a thread of its own; Publish and
// the destructor run once those threads are done.
//
//   ExportFiles files(out_dir);
//   ... per stream: FLATSHARD_RETURN_IF_ERROR(files.WriteChunk(message.chunk()));
//   FLATSHARD_RETURN_IF_ERROR(files.Publish());
#ifndef FLATSHARD_CLIENT_EXPORT_FILES_H_
#define FLATSHARD_CLIENT_EXPORT_FILES_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/file.h"
#include "proto/flatshard.pb.h"

namespace flatshard::client_internal {

class ExportFiles {
 public:
  // How the files are held until Publish.
  enum class Temporaries {
    kUnnamedWherePossible,  // unnamed files, or named ones where the file system has none
    kNamed,                 // always under their temporary names
  };

  // `out_dir` must exist.
  explicit ExportFiles(std::string out_dir, Temporaries temporaries = Temporaries::kUnnamedWherePossible);
  ~ExportFiles();  // removes the files not yet published
  ExportFiles(const ExportFiles&) = delete;
  ExportFiles& operator=(const ExportFiles&) = delete;

  // One chunk of a stream: announces (the first chunk of a file in any stream creates it,
  // with the blocks of its announced size reserved), fills or closes (fsyncs) a file.
  // DataLoss for a file name that is not a plain name in the directory; the file's errors
  // (ResourceExhausted when the disk or the process's file size limit is full) otherwise.
  [[nodiscard]] absl::Status WriteChunk(const v1::ExportChunk& chunk);

  // Names every file written (index files last), removes the earlier export's other
  // files and dead exports' temporary files, and fsyncs the directory. Call once, when
  // every stream has succeeded.
  [[nodiscard]] absl::Status Publish();

  // How long another export's temporary file must have gone unwritten, besides unlocked,
  // before Publish takes it for a dead export's: covers the moment between a running
  // export creating a named file and locking it.
  static constexpr absl::Duration kAbandonedAfter = absl::Minutes(1);

 private:
  // A file being written: unnamed, or under its temporary name (`named`), locked.
  struct Temporary {
    File file;
    bool named = false;
  };

  std::string TemporaryPath(const std::string& file) const;
  // The file `chunk` writes, created by the first chunk of it.
  [[nodiscard]] absl::StatusOr<File*> FileFor(const v1::ExportChunk& chunk);
  // Removes, in one pass over out_dir_, the files of an export's names but `published`
  // (their errors are returned) and other exports' temporary files that no live export
  // holds (best effort).
  [[nodiscard]] absl::Status RemoveStaleFiles(const std::vector<std::string>& published) const;

  const std::string out_dir_;
  const std::string suffix_;  // ".partial-<export id>"
  absl::Mutex mu_;
  bool unnamed_ ABSL_GUARDED_BY(mu_);  // until the file system refuses one
  // Files begun and not yet under their own names, by name (stable: streams write
  // through pointers to them).
  std::map<std::string, Temporary> files_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_EXPORT_FILES_H_
