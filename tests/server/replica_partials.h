// Test helper: carries a Group's shared partial (hybrid sharding, server/job.h) to the
// Group holding the same shard in another replica group, as StepDriver does over TCP.
#ifndef FLATSHARD_TESTS_SERVER_REPLICA_PARTIALS_H_
#define FLATSHARD_TESTS_SERVER_REPLICA_PARTIALS_H_

#include <cstring>

#include "server/group.h"

namespace flatshard::server::testing {

inline absl::StatusOr<CommitOutcome> DeliverPartial(const Group& from, Group& to, int64_t step) {
  absl::StatusOr<absl::Span<const std::byte>> partial = from.SharedPartial(step);
  if (!partial.ok()) return partial.status();
  absl::StatusOr<ReceiveSlot> slot = to.BeginReplicaPartial(step, from.placement().replica);
  if (!slot.ok()) return slot.status();
  std::memcpy(slot->buffer.data(), partial->data(), partial->size());
  return to.CommitReplicaPartial(*slot);
}

}  // namespace flatshard::server::testing

#endif  // FLATSHARD_TESTS_SERVER_REPLICA_PARTIALS_H_
