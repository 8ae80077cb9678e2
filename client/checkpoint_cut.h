// The cut of a save or export (Client::SaveCheckpoint, CutAt): which version of each
// group of a job every server pins, chosen from the servers' status, the steps that the
// calling client sent and the caller's CutAt; how many rounds the servers get to pin it;
// and what to tell a caller whose cut timed out waiting for training. Internal to the
// client library. Stateless functions.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto cut, ChooseCut("job", statuses, sent, CutAt::StepBoundary()));
//   FLATSHARD_RETURN_IF_ERROR(ExplainWait(streams.Pin(first, cut, "export", PinRounds(at)), sent, at));
#ifndef FLATSHARD_CLIENT_CHECKPOINT_CUT_H_
#define FLATSHARD_CLIENT_CHECKPOINT_CUT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/sent_steps.h"
#include "flatshard/client.h"
#include "proto/flatshard.pb.h"

namespace flatshard::client_internal {

// The versions of `job`'s groups on the server of `status`.
std::map<std::string, int64_t> ServerVersions(const std::string& job, const v1::ServerStatus& status);

// The consistent cut of a save or export of `job`, from every server's status (rank
// order): by default every group at the highest version any server has (servers of a
// synchronous job are at most one step apart; each waits until it gets there), and after
// step k where the caller sent step k last and a server holds its gradient for step k
// (GroupStatus.step_contributors: not applied yet, and not dropped by a load); in a job
// that clips or skips non-finite steps (its groups step together) every trained group
// at the highest of those, where they are at most a step apart. `at` moves the trained
// (not frozen) groups to a step boundary or a version; FailedPrecondition or
// InvalidArgument where that cut cannot be made, saying why.
[[nodiscard]] absl::StatusOr<std::map<std::string, int64_t>> ChooseCut(const std::string& job,
                                                                       const std::vector<v1::ServerStatus>& statuses,
                                                                       const SentSteps& sent, const CutAt& at);

// How many cuts a save or export tries while training keeps moving past them (a round
// costs a round trip; a server pinned at a cut holds its groups' next step). A cut that
// `at` names is tried once: a later one would not be it.
int PinRounds(const CutAt& at);

// `pinned`, the outcome of a cut's rounds, with why the cut waited for training where
// it did (DeadlineExceeded): after the step that the caller sent last (`sent`), at a
// step boundary or a version (`at`). Other outcomes as they are.
[[nodiscard]] absl::Status ExplainWait(const absl::Status& pinned, const SentSteps& sent, const CutAt& at);

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CHECKPOINT_CUT_H_
