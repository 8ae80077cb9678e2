// CheckpointProgress lists an operation exactly while its counter is held; CountingSink
// counts the bytes its sink accepted, and only those.
#include "server/checkpoint_progress.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

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

// A sink that accepts writes to "ok" and refuses the others.
class PickySink final : public CheckpointSink {
 public:
  absl::Status Open(const std::string&, uint64_t, bool) override { return absl::OkStatus(); }
  absl::Status Write(const std::string& file, uint64_t, absl::Span<const std::byte> data) override {
    if (file != "ok") return absl::InternalError("refused");
    written[file] += data.size();
    return absl::OkStatus();
  }
  absl::Status Close(const std::string&) override { return absl::OkStatus(); }
  std::map<std::string, uint64_t> written;
};

TEST(CheckpointProgressTest, CountingSinkCountsAcceptedBytes) {
  PickySink picky;
  ProgressCounter counter;
  CountingSink sink(picky, counter);
  const std::vector<std::byte> bytes(1000);
  ASSERT_TRUE(sink.Open("ok", 1000, true).ok());
  ASSERT_TRUE(sink.Write("ok", 0, absl::MakeConstSpan(bytes).subspan(0, 300)).ok());
  ASSERT_TRUE(sink.Write("ok", 300, absl::MakeConstSpan(bytes).subspan(300)).ok());
  EXPECT_FALSE(sink.Write("no", 0, bytes).ok());
  EXPECT_EQ(counter.done.load(), 1000u);
  EXPECT_EQ(picky.written["ok"], 1000u);
}

}  // namespace
}  // namespace flatshard::server
