// CheckpointCalls: the client side of checkpoints and state-dict export for one job
// (DESIGN.md "Checkpoints"): the consistent cut (client/checkpoint_cut.h) pinned on every
// server, the save/commit and prepare/commit protocols over every server, progress from
// the servers' status, and writing an exported stream into local files. Internal to the
// client library; Client's methods of the same names document each call. Thread-safe;
// every call blocks until done.
//
//   CheckpointCalls checkpoints(*control, "default", 4 << 20);
//   FLATSHARD_RETURN_IF_ERROR(checkpoints.Save("step-100", CheckpointKind::kFull, true, false, sent, {}, {}));
#ifndef FLATSHARD_CLIENT_CHECKPOINT_CALLS_H_
#define FLATSHARD_CLIENT_CHECKPOINT_CALLS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/call_cancellation.h"
#include "client/control_plane.h"
#include "client/sent_steps.h"
#include "flatshard/client.h"

namespace flatshard::client_internal {

class CheckpointCalls {
 public:
  // `control` must outlive this object.
  CheckpointCalls(const ControlPlane& control, std::string job, uint32_t export_chunk_bytes)
      : control_(control), job_(std::move(job)), export_chunk_bytes_(export_chunk_bytes) {}

  // `sent`: the steps the calling Client sent, for the cut, which `at` chooses (Export
  // likewise).
  [[nodiscard]] absl::Status Save(const std::string& name, CheckpointKind kind, bool optimizer, bool async,
                                  const SentSteps& sent, const CutAt& at, const Client::Progress& progress) const;
  // `non_strict`: Client::LoadCheckpointNonStrict (the strict load's lists are empty).
  [[nodiscard]] absl::StatusOr<IncompatibleTensors> Load(const std::string& name, bool non_strict,
                                                         const Client::Progress& progress) const;
  // `stop`: as in ControlPlane::Call.
  [[nodiscard]] absl::StatusOr<std::vector<CheckpointEntry>> List(std::stop_token stop = {}) const;
  [[nodiscard]] absl::Status Delete(const std::string& name, std::stop_token stop = {}) const;
  [[nodiscard]] absl::Status Export(const std::string& out_dir, CheckpointKind kind, bool optimizer,
                                    const SentSteps& sent, const CutAt& at, const Client::Progress& progress) const;
  [[nodiscard]] absl::StatusOr<ImportedCheckpoint> Import(const std::string& name, const std::string& in_dir,
                                                          bool optimizer, int64_t version,
                                                          const Client::Progress& progress) const;
  // Cancels the saves, loads, exports and imports in progress (Client::CancelCheckpointCalls).
  void CancelAll() const { cancellations_.CancelAll(); }

 private:
  // The calls above, which `cancellation` may cancel until they seal it.
  absl::Status Save(Cancellation& cancellation, const std::string& name, CheckpointKind kind, bool optimizer,
                    bool async, const SentSteps& sent, const CutAt& at, const Client::Progress& progress) const;
  absl::StatusOr<IncompatibleTensors> Load(Cancellation& cancellation, const std::string& name, bool non_strict,
                                           const Client::Progress& progress) const;
  absl::Status Export(Cancellation& cancellation, const std::string& out_dir, CheckpointKind kind, bool optimizer,
                      const SentSteps& sent, const CutAt& at, const Client::Progress& progress) const;
  absl::StatusOr<ImportedCheckpoint> Import(Cancellation& cancellation, const std::string& name,
                                            const std::string& in_dir, bool optimizer, int64_t version,
                                            const Client::Progress& progress) const;
  // Every server's status; kWithout leaves out the groups (a model may have tens of
  // thousands), which only a save's or an export's cut reads.
  enum class Groups { kWith, kWithout };
  absl::StatusOr<std::vector<v1::ServerStatus>> Statuses(Groups groups, std::stop_token stop = {}) const;
  absl::Status WithProgress(const std::string& name, const std::string& operation,
                            const Client::Progress& progress,
                            const std::function<absl::Status()>& body) const;

  const ControlPlane& control_;
  const std::string job_;
  const uint32_t export_chunk_bytes_;
  mutable CancellationSet cancellations_;
};

// What a load's COMMIT came to, from every server's answer (by rank): OK when all
// committed; the first failure as it is when none did. When some committed and others
// did not, the job's groups hold the checkpoint on some servers and their old state on
// the others: the first failure's code, with a message naming which servers did what and
// that the load must be done again.
[[nodiscard]] absl::Status LoadCommitOutcome(const std::string& name, const std::vector<absl::Status>& committed);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CHECKPOINT_CALLS_H_
