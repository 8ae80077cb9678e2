// Contributions in parts (SlotPart): a contribution counts once its last part lands, in
// any order, with the same bits as a whole one; parts that do not split the slot, or
// that collide with parts in flight, are refused; a failed part is sent again while the
// parts that arrived stay; a load drops parts in flight.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "server/group.h"

namespace flatshard::server {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kNumel = 1000;  // one shard: 4000 bytes in float32, 3 parts of 1344 at most

std::shared_ptr<Group> MakeGroup(int workers, bool async = false) {
  auto layout = FlatLayout::Create({{"w", {kNumel}, DType::kFloat32}}, 0, 1);
  return *Group::Create("job", "g", *layout, Placement{},
                        JobSettings{.num_workers = workers, .reduce_mean = false, .async = async},
                        kernels::SgdHyperparams{.lr = 1.0f});
}

std::vector<float> RandomGradient(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> grad(kNumel);
  for (float& value : grad) value = uniform(rng);
  return grad;
}

// Reserves `part` of worker `worker`'s float32 gradient `grad` for `step` and fills it.
absl::StatusOr<ReceiveSlot> BeginPart(Group& group, int64_t step, int worker, const std::vector<float>& grad,
                                      SlotPart part) {
  absl::StatusOr<std::pair<size_t, size_t>> range = group.PartRange(DType::kFloat32, part);
  if (!range.ok()) return range.status();
  absl::StatusOr<ReceiveSlot> slot = group.BeginScatter(step, worker, DType::kFloat32, SlotMemory::kHost, part);
  if (!slot.ok()) return slot.status();
  EXPECT_EQ(slot->buffer.size(), range->second);
  std::memcpy(slot->buffer.data(), reinterpret_cast<const std::byte*>(grad.data()) + range->first, range->second);
  return slot;
}

absl::StatusOr<CommitOutcome> SendPart(Group& group, int64_t step, int worker, const std::vector<float>& grad,
                                       SlotPart part) {
  absl::StatusOr<ReceiveSlot> slot = BeginPart(group, step, worker, grad, part);
  if (!slot.ok()) return slot.status();
  return group.CommitScatter(*slot);
}

std::vector<float> Params(Group& group) {
  absl::StatusOr<GatherSnapshot> snapshot = group.Gather(0, DType::kFloat32, absl::InfiniteFuture());
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  std::vector<float> values(group.shard_numel());
  std::memcpy(values.data(), snapshot->bytes->data(), snapshot->bytes->size());
  return values;
}

TEST(GroupPartsTest, AContributionCountsWhenItsLastPartLandsInAnyOrderWithTheBitsOfAWholeOne) {
  const std::vector<float> g0 = RandomGradient(1), g1 = RandomGradient(2);
  std::shared_ptr<Group> whole = MakeGroup(2), parted = MakeGroup(2);
  ASSERT_TRUE(SendPart(*whole, 0, 0, g0, {}).ok());
  ASSERT_TRUE(SendPart(*whole, 0, 1, g1, {}).ok());
  ASSERT_EQ(whole->version(), 1);

  // Worker 0's parts 2 and 0 are received at once, then part 1.
  absl::StatusOr<ReceiveSlot> two = BeginPart(*parted, 0, 0, g0, {2, 3});
  absl::StatusOr<ReceiveSlot> zero = BeginPart(*parted, 0, 0, g0, {0, 3});
  ASSERT_TRUE(two.ok() && zero.ok()) << two.status() << zero.status();
  EXPECT_EQ(*parted->CommitScatter(*zero), CommitOutcome::kPending);
  EXPECT_EQ(*parted->CommitScatter(*two), CommitOutcome::kPending);
  EXPECT_EQ(parted->stats().pending_contributions, 0);  // not complete yet
  EXPECT_EQ(*SendPart(*parted, 0, 0, g0, {1, 3}), CommitOutcome::kPending);
  EXPECT_EQ(parted->stats().pending_contributions, 1);
  EXPECT_EQ(parted->version(), 0);
  EXPECT_EQ(*SendPart(*parted, 0, 1, g1, {1, 2}), CommitOutcome::kPending);
  EXPECT_EQ(*SendPart(*parted, 0, 1, g1, {0, 2}), CommitOutcome::kApplied);
  ASSERT_EQ(parted->version(), 1);
  EXPECT_EQ(Params(*parted), Params(*whole));
  // SGD lr 1 from zeros, summed: -(g0 + g1), each element one float addition.
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(Params(*parted)[i], -(g0[i] + g1[i])) << i;

  // A resend of a part of the applied contribution learns that it arrived.
  EXPECT_EQ(SendPart(*parted, 0, 0, g0, {1, 3}).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(GroupPartsTest, AnAsyncContributionStepsOnceItsLastPartLands) {
  const std::vector<float> grad = RandomGradient(3);
  std::shared_ptr<Group> group = MakeGroup(2, /*async=*/true);
  EXPECT_EQ(*SendPart(*group, 0, 1, grad, {1, 2}), CommitOutcome::kPending);
  EXPECT_EQ(group->version(), 0);
  EXPECT_EQ(*SendPart(*group, 0, 1, grad, {0, 2}), CommitOutcome::kApplied);
  EXPECT_EQ(group->version(), 1);
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(Params(*group)[i], -grad[i]) << i;
  EXPECT_EQ(SendPart(*group, 0, 1, grad, {0, 2}).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(GroupPartsTest, PartsThatDoNotSplitTheSlotAreRefusedByName) {
  std::shared_ptr<Group> group = MakeGroup(1);
  const std::vector<float> grad(kNumel, 1.0f);
  for (SlotPart bad : {SlotPart{0, 0}, SlotPart{3, 3}, SlotPart{-1, 2}, SlotPart{0, 65}}) {
    const absl::Status refused = SendPart(*group, 0, 0, grad, bad).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << bad.index << "/" << bad.count;
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr(absl::StrCat("scatter part ", bad.index, " of ", bad.count, " to group 'g'")));
  }
  // 4000 bytes in 64-byte lines make 63 parts, not 64.
  const absl::Status too_many = group->BeginScatter(0, 0, DType::kFloat32, SlotMemory::kHost, {0, 64}).status();
  EXPECT_THAT(std::string(too_many.message()),
              HasSubstr("a 4000-byte float32 slice splits into 63 parts when asked for 64"));
  const absl::Status device = group->BeginScatter(0, 0, DType::kFloat32, SlotMemory::kDevice, {0, 2}).status();
  EXPECT_EQ(device.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(device.message()), HasSubstr("comes whole, not in parts"));
  // None of it reserved anything.
  ASSERT_TRUE(SendPart(*group, 0, 0, grad, {}).ok());
  EXPECT_EQ(group->version(), 1);
}

TEST(GroupPartsTest, APartInFlightIsReservedOnceAndOtherShapesWaitForIt) {
  std::shared_ptr<Group> group = MakeGroup(1);
  const std::vector<float> grad = RandomGradient(4);
  absl::StatusOr<ReceiveSlot> zero = BeginPart(*group, 0, 0, grad, {0, 2});
  ASSERT_TRUE(zero.ok()) << zero.status();
  const absl::Status twice = group->BeginScatter(0, 0, DType::kFloat32, SlotMemory::kHost, {0, 2}).status();
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(twice.message()), HasSubstr("already being received"));
  for (SlotPart other : {SlotPart{0, 3}, SlotPart{}}) {
    EXPECT_EQ(group->BeginScatter(0, 0, DType::kFloat32, SlotMemory::kHost, other).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(group->BeginScatter(0, 0, DType::kBFloat16, SlotMemory::kHost, {1, 2}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*group->CommitScatter(*zero), CommitOutcome::kPending);
  EXPECT_EQ(*SendPart(*group, 0, 0, grad, {1, 2}), CommitOutcome::kApplied);
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(Params(*group)[i], -grad[i]) << i;
}

TEST(GroupPartsTest, AFailedPartIsSentAgainWhileThePartsThatArrivedStay) {
  std::shared_ptr<Group> group = MakeGroup(1);
  const std::vector<float> grad = RandomGradient(5);
  EXPECT_EQ(*SendPart(*group, 0, 0, grad, {0, 2}), CommitOutcome::kPending);
  absl::StatusOr<ReceiveSlot> one = BeginPart(*group, 0, 0, grad, {1, 2});
  ASSERT_TRUE(one.ok()) << one.status();
  group->AbortScatter(*one);  // its connection died
  EXPECT_EQ(group->version(), 0);
  EXPECT_EQ(*SendPart(*group, 0, 0, grad, {1, 2}), CommitOutcome::kApplied);
  EXPECT_EQ(group->version(), 1);
  std::vector<float> expected(kNumel);
  for (int64_t i = 0; i < kNumel; ++i) expected[i] = -grad[i];
  EXPECT_EQ(Params(*group), expected);

  // Half of an attempt in parts, given up on: a whole resend starts afresh and only its
  // bytes count (the half's were the other gradient's).
  const std::vector<float> first = RandomGradient(6), second = RandomGradient(7);
  EXPECT_EQ(*SendPart(*group, 1, 0, first, {0, 2}), CommitOutcome::kPending);
  EXPECT_EQ(*SendPart(*group, 1, 0, second, {}), CommitOutcome::kApplied);
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(Params(*group)[i], expected[i] - second[i]) << i;
}

TEST(GroupPartsTest, ALoadDropsThePartsInFlight) {
  std::shared_ptr<Group> group = MakeGroup(1);
  const std::vector<float> grad = RandomGradient(8);
  EXPECT_EQ(*SendPart(*group, 0, 0, grad, {0, 2}), CommitOutcome::kPending);
  absl::StatusOr<ReceiveSlot> one = BeginPart(*group, 0, 0, grad, {1, 2});
  ASSERT_TRUE(one.ok()) << one.status();
  absl::StatusOr<ShardBuffer> params = AllocateHostUnwritten(kNumel * sizeof(float), "test");
  ASSERT_TRUE(params.ok()) << params.status();
  std::fill_n(params->floats(), kNumel, 2.0f);
  LoadedShard loaded;
  loaded.version = 0;
  loaded.params = *std::move(params);
  ASSERT_TRUE(group->Restore(std::move(loaded), /*load_id=*/1).ok());
  const absl::Status dropped = group->CommitScatter(*one).status();
  EXPECT_EQ(dropped.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(dropped.message()), HasSubstr("was dropped while it arrived (the group was loaded)"));
  EXPECT_EQ(group->version(), 0);
  EXPECT_EQ(*SendPart(*group, 0, 0, grad, {}), CommitOutcome::kApplied);
  for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(Params(*group)[i], 2.0f - grad[i]) << i;
}

}  // namespace
}  // namespace flatshard::server
