// Test helper: carries a hybrid-sharded job's exchange (server/group.h) between the
// Groups that hold one shard in every replica group, as StepDriver does over TCP.
#ifndef FLATSHARD_TESTS_SERVER_REPLICA_PARTIALS_H_
#define FLATSHARD_TESTS_SERVER_REPLICA_PARTIALS_H_

#include <cstring>
#include <vector>

#include "absl/types/span.h"
#include "server/group.h"

namespace flatshard::server::testing {

inline absl::StatusOr<CommitOutcome> Carry(Exchange what, const ExchangeRound& round, absl::Span<const std::byte> bytes,
                                           const Group& from, Group& to) {
  absl::StatusOr<ReceiveSlot> slot = to.BeginExchange(what, round, from.placement().replica);
  if (!slot.ok()) return slot.status();
  if (slot->buffer.size() != bytes.size()) return absl::InternalError("chunk sizes differ");
  if (!bytes.empty()) std::memcpy(slot->buffer.data(), bytes.data(), bytes.size());
  return to.CommitExchange(what, *slot);
}

// `from`'s partial of the chunk that `to` reduces (kShare's part for `to`).
inline absl::StatusOr<CommitOutcome> DeliverPartial(const Group& from, Group& to, int64_t step) {
  absl::StatusOr<OutgoingChunk> partial = from.SharedPartial(step);
  if (!partial.ok()) return partial.status();
  const auto [offset, numel] = from.ReplicaChunk(to.placement().replica);
  return Carry(Exchange::kPartial, partial->round,
               partial->bytes.subspan(offset * sizeof(float), numel * sizeof(float)), from, to);
}

// `from`'s reduced chunk (kBroadcast's part for `to`).
inline absl::StatusOr<CommitOutcome> DeliverReduced(const Group& from, Group& to, int64_t step) {
  absl::StatusOr<OutgoingChunk> chunk = from.BroadcastChunk(step);
  if (!chunk.ok()) return chunk.status();
  return Carry(Exchange::kReduced, chunk->round, chunk->bytes, from, to);
}

// The whole exchange for `step` between `groups` (one per replica group, in replica
// order), each with its partial summed (kShare): every partial chunk to its owner, then
// every reduced chunk to the others. Returns each group's last outcome. For groups never
// loaded (their rounds are of load 0).
inline absl::StatusOr<std::vector<CommitOutcome>> ExchangeAll(absl::Span<Group* const> groups,
                                                              int64_t step) {
  std::vector<CommitOutcome> outcomes;
  for (Group* from : groups) {
    for (Group* to : groups) {
      if (to == from) continue;
      absl::StatusOr<CommitOutcome> delivered = DeliverPartial(*from, *to, step);
      if (!delivered.ok()) return delivered.status();
    }
  }
  for (Group* group : groups) {
    absl::StatusOr<CommitOutcome> own = group->CommitOwnPartial({.step = step});
    if (!own.ok()) return own.status();
    if (*own != CommitOutcome::kBroadcast) return absl::InternalError("own partial did not complete a chunk");
  }
  for (Group* from : groups) {
    for (Group* to : groups) {
      if (to == from) continue;
      absl::StatusOr<CommitOutcome> delivered = DeliverReduced(*from, *to, step);
      if (!delivered.ok()) return delivered.status();
    }
  }
  for (Group* group : groups) {
    absl::StatusOr<CommitOutcome> own = group->CommitBroadcast({.step = step});
    if (!own.ok()) return own.status();
    outcomes.push_back(*own);
  }
  return outcomes;
}

}  // namespace flatshard::server::testing

#endif  // FLATSHARD_TESTS_SERVER_REPLICA_PARTIALS_H_
