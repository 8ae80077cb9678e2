// CheckpointProgress lists an operation exactly while its counter is held; a save's
// writers count the tensor bytes their sink accepted, and only those.
#include "server/checkpoint_progress.h"

#include <gtest/gtest.h>

#include <vector>

#include "server/checkpoint_writer.h"
#include "server/registry.h"

namespace flatshard::server {
namespace {

TEST(CheckpointProgressTest, ListsAnOperationWhileItsCounterIsHeld) {
  CheckpointProgress progress;
  EXPECT_TRUE(progress.Rows().empty());
  std::shared_ptr<ProgressCounter> save = progress.Start("a", "save");
  std::shared_ptr<ProgressCounter> load = progress.Start("b", "load");
  save->total = 100;
  save->done += 40;
  std::vector<ProgressRow> rows = progress.Rows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].name, "a");
  EXPECT_EQ(rows[0].operation, "save");
  EXPECT_EQ(rows[0].done, 40u);
  EXPECT_EQ(rows[0].total, 100u);
  EXPECT_EQ(rows[1].name, "b");
  save.reset();
  rows = progress.Rows();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].operation, "load");
}

// A sink that takes every write and counts its bytes, or with `refuse_after` refuses
// the writes after that many.
class TallySink final : public CheckpointSink {
 public:
  explicit TallySink(int refuse_after = -1) : refuse_after_(refuse_after) {}
  absl::Status Open(const std::string&, uint64_t, bool) override { return absl::OkStatus(); }
  absl::Status Write(const std::string&, uint64_t, absl::Span<const std::byte> data) override {
    if (refuse_after_ >= 0 && writes_ >= refuse_after_) return absl::InternalError("refused");
    ++writes_;
    bytes += data.size();
    return absl::OkStatus();
  }
  absl::Status Close(const std::string&) override { return absl::OkStatus(); }
  uint64_t bytes = 0;

 private:
  const int refuse_after_;
  int writes_ = 0;
};

// A save's progress counts its tensor bytes, the headers and split indexes aside: done
// ends exactly at the total the server announces (PartBytes) and never passes it.
TEST(CheckpointProgressTest, WritersCountTensorBytesUpToPartBytesExactly) {
  Registry registry(/*rank=*/0, /*num_servers=*/2);
  ASSERT_TRUE(registry.ConfigureJob("job", {.num_workers = 1}).ok());
  ASSERT_TRUE(registry
                  .RegisterGroup("job", "g", {{"w", {300, 5}, DType::kBFloat16}, {"b", {7}, DType::kFloat32}}, 0,
                                 kernels::AdamHyperparams{.lr = 0.01f})
                  .ok());
  ASSERT_TRUE(registry.RegisterGroup("job", "h", {{"s", {9}, DType::kFloat32}}, 0,
                                     kernels::SgdHyperparams{.lr = 0.1f, .momentum = 0.9f})
                  .ok());
  absl::StatusOr<std::vector<SavedShard>> shards =
      TakeShards(registry, 0, "job", {{"g", 0}, {"h", 0}}, absl::InfiniteFuture(), /*pin=*/false);
  ASSERT_TRUE(shards.ok()) << shards.status();
  for (CheckpointKind kind : {CheckpointKind::kFull, CheckpointKind::kSharded, CheckpointKind::kLocal}) {
    for (bool optimizer : {false, true}) {
      for (uint64_t max_file_bytes : {uint64_t{1} << 30, uint64_t{100}}) {  // FULL: one file, or split
        SCOPED_TRACE(::testing::Message() << CheckpointKindName(kind) << " optimizer " << optimizer
                                          << " max_file_bytes " << max_file_bytes);
        TallySink sink;
        ProgressCounter progress;
        ASSERT_TRUE(WriteShards(sink, 0, kind, optimizer, max_file_bytes, *shards, nullptr, &progress).ok());
        const uint64_t total = PartBytes(kind, optimizer, *shards);
        EXPECT_GE(total, 750u * 2);  // at least this server's half of w, in bf16 for FULL
        EXPECT_EQ(progress.done.load(), total);
        EXPECT_GT(sink.bytes, total);  // headers were written, and not counted
      }
    }
  }
  // Bytes a sink refused are not counted.
  TallySink refusing(/*refuse_after=*/1);  // the header only
  ProgressCounter progress;
  EXPECT_FALSE(WriteShards(refusing, 0, CheckpointKind::kSharded, true, 1 << 30, *shards, nullptr, &progress).ok());
  EXPECT_EQ(progress.done.load(), 0u);
}

}  // namespace
}  // namespace flatshard::server
