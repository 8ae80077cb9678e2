// Random sequences of training steps and checkpoint operations (save of every kind, with
// and without optimizer state, blocking and async; load, delete, list, export) against
// real servers, checked at every operation against a model of what the checkpoint
// directory should hold. RandomOperationsMatchAModelOfTheCheckpoints waits for every
// async save to commit and checks exact statuses (OK, AlreadyExists, NotFound), the
// listing, and after each load the exact parameters and version that were saved.
// OverlappingAsyncSavesKeepTheirCuts lets async saves run on under the operations that
// follow them (their outcome then depends on timing) and checks invariants instead: a
// save in progress holds its name, a checkpoint appears only once complete and only if
// saved, and every save that was accepted commits exactly the cut it was asked for.
// ConcurrentSavesOfOneNameCommitOneOfThem races two callers' saves of one name, and
// AnExportWhileTrainingStreamsOneCut an export with a training step. The seed is fixed
// (FLATSHARD_CHECKPOINT_SEED explores others); a failure names the operation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/file.h"
#include "core/safetensors.h"
#include "tests/integration/test_cluster.h"
#include "tests/scratch_dir.h"

namespace flatshard {
namespace {

// What a complete checkpoint holds.
struct Saved {
  int64_t version = 0;
  std::map<std::string, std::vector<float>> params;  // by group
};

// FLATSHARD_CHECKPOINT_SEED if set, else `fixed`.
uint32_t Seed(uint32_t fixed) {
  const char* text = std::getenv("FLATSHARD_CHECKPOINT_SEED");
  return text != nullptr ? static_cast<uint32_t>(std::strtoul(text, nullptr, 10)) : fixed;
}

using GroupSpec = std::tuple<std::string, std::vector<TensorSpec>, OptimizerOptions>;

class CheckpointModelTest : public ::testing::Test {
 protected:
  // The groups of the job; a subclass may add some.
  virtual std::vector<GroupSpec> Groups() const {
    return {{"g", {{"w", {1000}, DType::kFloat32}}, SgdOptions{.lr = 0.1, .momentum = 0.9}},
            {"h", {{"a", {37, 3}, DType::kFloat32}, {"b", {5}, DType::kFloat32}}, AdamOptions{.lr = 0.01}}};
  }

  void SetUp() override {
    auto client = cluster_.Connect(0, 1, "m");
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    ASSERT_TRUE(client_->ConfigureJob({}).ok());
    for (const auto& [name, tensors, optimizer] : Groups()) {
      auto layout = client_->RegisterGroup(name, tensors, 0, optimizer);
      ASSERT_TRUE(layout.ok()) << layout.status();
      layouts_[name] = *layout;
      ASSERT_TRUE(client_->InitGroupFromSeed(name, 7).ok());
    }
  }

  // Every group's parameters at the current version (which they must be at).
  std::map<std::string, std::vector<float>> Params() {
    std::map<std::string, std::vector<float>> params;
    for (const auto& [name, layout] : layouts_) {
      std::vector<float> values(layout->padded_numel());
      auto version = client_->Gather(name, 0, DType::kFloat32, AsBytes(values)).get();
      EXPECT_TRUE(version.ok()) << version.status();
      EXPECT_EQ(version.value_or(-1), version_) << "group " << name;
      params[name] = std::move(values);
    }
    return params;
  }

  // One training step of every group with random gradients.
  void Step(std::mt19937& rng) {
    std::normal_distribution<float> normal;
    for (const auto& [name, layout] : layouts_) {
      std::vector<float> grad(layout->padded_numel());
      for (float& g : grad) g = normal(rng);
      const absl::Status sent = client_->Scatter(name, version_, DType::kFloat32, AsBytes(grad)).get();
      ASSERT_TRUE(sent.ok()) << sent;
    }
    ++version_;
    for (const auto& [name, layout] : layouts_) {
      auto reached = client_->WaitVersion(name, version_);
      ASSERT_TRUE(reached.ok()) << reached.status();
    }
  }

  // Every group's parameters equal `saved`'s (the first difference, if not: the groups
  // may be large).
  void ExpectParams(const Saved& saved) {
    for (const auto& [group, values] : Params()) {
      const std::vector<float>& expected = saved.params.at(group);
      ASSERT_EQ(values.size(), expected.size()) << "group " << group;
      const auto [differs, _] = std::mismatch(values.begin(), values.end(), expected.begin());
      EXPECT_TRUE(differs == values.end()) << "group " << group << " element " << (differs - values.begin()) << " is "
                                           << *differs << ", saved " << expected[differs - values.begin()];
    }
  }

  // The names of the complete checkpoints, once no save is still being written (an
  // async save lists as incomplete until every server has committed its part).
  std::set<std::string> CompleteCheckpoints() {
    for (int attempt = 0; attempt < 200; ++attempt) {
      auto list = client_->ListCheckpoints();
      EXPECT_TRUE(list.ok()) << list.status();
      if (!list.ok()) return {};
      std::set<std::string> names;
      bool writing = false;
      for (const CheckpointEntry& entry : *list) {
        if (entry.complete) names.insert(entry.name);
        writing = writing || !entry.complete;
      }
      if (!writing) return names;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ADD_FAILURE() << "a save stayed incomplete for 10 s";
    return {};
  }

  const testing::ScratchDir root_{"ckpt-model"};
  const testing::ScratchDir exports_{"ckpt-model-exports"};
  testing::TestCluster cluster_{3, "tok", ::testing::TempDir(), root_.path()};
  std::unique_ptr<Client> client_;
  std::map<std::string, const FlatLayout*> layouts_;
  int64_t version_ = 0;
  static constexpr CheckpointKind kKinds[] = {CheckpointKind::kFull, CheckpointKind::kSharded, CheckpointKind::kLocal};
};

TEST_F(CheckpointModelTest, RandomOperationsMatchAModelOfTheCheckpoints) {
  const char* seed_text = std::getenv("FLATSHARD_CHECKPOINT_SEED");
  const uint32_t seed = Seed(20261123);
  std::mt19937 rng(seed);
  auto below = [&](uint32_t n) { return rng() % n; };
  std::map<std::string, Saved> model;  // the complete checkpoints
  const std::string names[] = {"a", "b", "c"};
  int loads = 0, saves = 0;
  for (int op = 0; op < 150; ++op) {
    const std::string name = names[below(3)];
    const uint32_t choice = below(20);
    SCOPED_TRACE(
        absl::StrCat("seed ", seed, ", operation ", op, " (", choice, ") on '", name, "' at version ", version_));
    if (choice < 7) {
      Step(rng);
      ASSERT_FALSE(HasFatalFailure());
    } else if (choice < 12) {
      const CheckpointKind kind = kKinds[below(3)];
      const bool optimizer = below(2) == 0, async = below(2) == 0;
      SCOPED_TRACE(absl::StrCat("save ", CheckpointKindName(kind), optimizer ? " with" : " without", " optimizer state",
                                async ? ", async" : ""));
      const absl::Status saved = client_->SaveCheckpoint(name, kind, optimizer, async);
      if (model.count(name) != 0) {
        EXPECT_TRUE(absl::IsAlreadyExists(saved)) << saved;
        continue;
      }
      ASSERT_TRUE(saved.ok()) << saved;
      ++saves;
      model[name] = {version_, Params()};
      EXPECT_EQ(CompleteCheckpoints().count(name), 1u);
    } else if (choice < 15) {
      SCOPED_TRACE("load");
      const absl::Status loaded = client_->LoadCheckpoint(name);
      const auto it = model.find(name);
      if (it == model.end()) {
        EXPECT_TRUE(absl::IsNotFound(loaded)) << loaded;
        continue;
      }
      ASSERT_TRUE(loaded.ok()) << loaded;
      ++loads;
      version_ = it->second.version;
      ExpectParams(it->second);
    } else if (choice < 17) {
      SCOPED_TRACE("delete");
      const absl::Status deleted = client_->DeleteCheckpoint(name);
      EXPECT_EQ(deleted.code(), model.erase(name) != 0 ? absl::StatusCode::kOk : absl::StatusCode::kNotFound)
          << deleted;
    } else if (choice < 19) {
      SCOPED_TRACE("list");
      std::set<std::string> expected;
      for (const auto& [saved_name, saved] : model) expected.insert(saved_name);
      EXPECT_EQ(CompleteCheckpoints(), expected);
    } else {
      const CheckpointKind kind = below(2) == 0 ? CheckpointKind::kFull : CheckpointKind::kSharded;
      SCOPED_TRACE(absl::StrCat("export ", CheckpointKindName(kind)));
      const std::string dir = absl::StrCat(exports_.path(), "/", op);
      const absl::Status exported = client_->ExportStateDict(dir, kind, below(2) == 0);
      ASSERT_TRUE(exported.ok()) << exported;
      EXPECT_FALSE(std::filesystem::is_empty(dir));
    }
  }
  // The fixed seed reaches every branch; other seeds should too, mostly.
  RecordProperty("saves", saves);
  RecordProperty("loads", loads);
  if (seed_text == nullptr) {
    EXPECT_GT(saves, 0);
    EXPECT_GT(loads, 0);
  }
}

// Two callers save one name at once, as two workers of a job might, one of them after a
// training step and perhaps async: whatever the timing, exactly one save succeeds, the
// loser is told ALREADY_EXISTS, and the checkpoint holds the winner's cut (listed with its versions,
// loading exactly their parameters). The step may overtake the
// first caller's cut on a server before that server pins it (the save then pins a later
// cut), and that cut may be mid-step (one group before the step, the other after), so
// each round starts from a checkpoint of its own step boundary.
TEST_F(CheckpointModelTest, ConcurrentSavesOfOneNameCommitOneOfThem) {
  const uint32_t seed = Seed(20261125);
  std::mt19937 rng(seed);
  auto other = cluster_.Connect(0, 1, "m");
  ASSERT_TRUE(other.ok()) << other.status();
  std::map<int64_t, Saved> cuts;  // what the job held at every version a save may cut at
  for (int round = 0; round < 16; ++round) {
    const std::string name = absl::StrCat("r", round);
    const CheckpointKind kind = kKinds[rng() % 3];
    const bool step = rng() % 2 == 0, async = rng() % 2 == 0;
    SCOPED_TRACE(absl::StrCat("seed ", seed, ", round ", round, ": ", CheckpointKindName(kind),
                              step ? ", the second caller steps first" : "", async ? ", async" : ""));
    const std::string boundary = absl::StrCat("boundary-", round);
    ASSERT_TRUE(client_->SaveCheckpoint(boundary, CheckpointKind::kLocal, /*optimizer=*/true).ok());
    const int64_t boundary_version = version_;
    cuts[version_] = {version_, Params()};
    absl::Status first;
    std::thread racing([&] { first = (*other)->SaveCheckpoint(name, kind, /*optimizer=*/true); });
    if (step) Step(rng);
    cuts[version_] = {version_, Params()};
    const absl::Status second = client_->SaveCheckpoint(name, kind, /*optimizer=*/true, async);
    racing.join();
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_NE(first.ok(), second.ok()) << "not exactly one save succeeded: " << first << "; " << second;
    for (const absl::Status& saved : {first, second}) {
      EXPECT_TRUE(saved.ok() || absl::IsAlreadyExists(saved)) << saved;
    }
    CompleteCheckpoints();  // an async save commits by itself
    auto entries = client_->ListCheckpoints();
    ASSERT_TRUE(entries.ok()) << entries.status();
    const auto entry = std::find_if(entries->begin(), entries->end(),
                                    [&](const CheckpointEntry& e) { return e.name == name && e.complete; });
    if (!first.ok() && !second.ok()) {
      EXPECT_TRUE(entry == entries->end()) << "neither save succeeded, yet it is complete";
      continue;
    }
    ASSERT_TRUE(entry != entries->end()) << "a save succeeded; it is not listed complete";
    ASSERT_TRUE(client_->LoadCheckpoint(name).ok());
    for (const auto& [group, layout] : layouts_) {
      const int64_t version = entry->versions.at(group);
      ASSERT_EQ(cuts.count(version), 1u) << "group " << group << " is listed at version " << version;
      if (second.ok()) {
        EXPECT_EQ(version, version_) << "group " << group;  // the second caller cut after any step
      }
      std::vector<float> values(layout->padded_numel());
      auto gathered = client_->Gather(group, 0, DType::kFloat32, AsBytes(values)).get();
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      EXPECT_EQ(*gathered, version) << "group " << group;
      EXPECT_TRUE(values == cuts.at(version).params.at(group)) << "group " << group << " is not its cut";
    }
    ASSERT_TRUE(client_->LoadCheckpoint(boundary).ok());
    version_ = boundary_version;
  }
}

// An export started as a training step runs (the step can move groups past the export's
// cut on some servers before they pin it) streams one cut all the same: each group's
// tensors in the exported file are that group's parameters from before the step or from
// after it.
TEST_F(CheckpointModelTest, AnExportWhileTrainingStreamsOneCut) {
  const uint32_t seed = Seed(20261126);
  std::mt19937 rng(seed);
  auto other = cluster_.Connect(0, 1, "m");
  ASSERT_TRUE(other.ok()) << other.status();
  for (int round = 0; round < 12; ++round) {
    SCOPED_TRACE(absl::StrCat("seed ", seed, ", round ", round));
    const std::map<std::string, std::vector<float>> before = Params();
    const std::string dir = absl::StrCat(exports_.path(), "/race-", round);
    absl::Status exported;
    std::thread racing([&] { exported = (*other)->ExportStateDict(dir, CheckpointKind::kFull, false); });
    Step(rng);
    const std::map<std::string, std::vector<float>> after = Params();
    racing.join();
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_TRUE(exported.ok()) << exported;
    auto header = SafetensorsHeader::Read(dir + "/model.safetensors");
    ASSERT_TRUE(header.ok()) << header.status();
    auto file = File::Open(dir + "/model.safetensors", File::Mode::kRead);
    ASSERT_TRUE(file.ok()) << file.status();
    for (const auto& [group, layout] : layouts_) {
      bool is_before = true, is_after = true;
      for (int t = 0; t < layout->num_tensors(); ++t) {
        const SafetensorsTensor* tensor = header->Find(layout->tensor(t).fqn);
        ASSERT_NE(tensor, nullptr) << layout->tensor(t).fqn;
        std::vector<float> values(static_cast<size_t>(layout->tensor_numel(t)));
        ASSERT_EQ(tensor->end - tensor->begin, values.size() * sizeof(float));
        ASSERT_TRUE(file->ReadAt(header->data_start() + tensor->begin, AsBytes(values)).ok());
        const auto at = [&](const std::vector<float>& flat) { return flat.begin() + layout->tensor_offset(t); };
        is_before = is_before && std::equal(values.begin(), values.end(), at(before.at(group)));
        is_after = is_after && std::equal(values.begin(), values.end(), at(after.at(group)));
      }
      EXPECT_TRUE(is_before || is_after) << "group " << group << " is neither before nor after the step";
    }
  }
}

// A group large enough (8 MiB of parameters, 24 MiB with Adam's state per save)
// that an async save is still being written while the next operations run.
class CheckpointOverlapTest : public CheckpointModelTest {
 protected:
  std::vector<GroupSpec> Groups() const override {
    std::vector<GroupSpec> groups = CheckpointModelTest::Groups();
    groups.push_back({"big", {{"e", {1024, 2048}, DType::kFloat32}}, AdamOptions{.lr = 0.001}});
    return groups;
  }
};

TEST_F(CheckpointOverlapTest, OverlappingAsyncSavesKeepTheirCuts) {
  const uint32_t seed = Seed(20261124);
  std::mt19937 rng(seed);
  auto below = [&](uint32_t n) { return rng() % n; };
  std::map<std::string, Saved> complete;  // known to be committed
  std::map<std::string, Saved> pending;   // accepted async saves, perhaps still being written
  // A listing: every committed checkpoint is there and complete; a complete one is
  // committed or pending (which it then no longer is); an incomplete one is pending.
  auto check_listing = [&](std::vector<CheckpointEntry> entries) {
    // A commit renaming the directory while the server lists the root may show a save
    // both ways: the incomplete entry is then taken first.
    std::stable_partition(entries.begin(), entries.end(), [](const CheckpointEntry& e) { return !e.complete; });
    std::set<std::string> listed;
    for (const CheckpointEntry& entry : entries) {
      if (entry.complete) listed.insert(entry.name);
      if (complete.count(entry.name) != 0) {
        EXPECT_TRUE(entry.complete) << "'" << entry.name << "' was committed; it is listed incomplete";
      } else if (const auto it = pending.find(entry.name); it == pending.end()) {
        ADD_FAILURE() << "'" << entry.name << "' is listed (" << (entry.complete ? "" : "in")
                      << "complete) but no save of it is outstanding";
      } else if (entry.complete) {
        EXPECT_EQ(entry.versions.at("big"), it->second.version) << "'" << entry.name << "'";
        complete.insert(pending.extract(it));
      }
    }
    for (const auto& [name, saved] : complete) EXPECT_EQ(listed.count(name), 1u) << "'" << name << "' is not listed";
  };
  int overlapped = 0;  // operations that met a save still being written
  for (int op = 0; op < 120; ++op) {
    const std::string name = std::string(1, static_cast<char>('a' + below(3)));
    const uint32_t choice = below(20);
    SCOPED_TRACE(
        absl::StrCat("seed ", seed, ", operation ", op, " (", choice, ") on '", name, "' at version ", version_));
    if (choice < 6) {
      Step(rng);
      ASSERT_FALSE(HasFatalFailure());
    } else if (choice < 11) {
      const CheckpointKind kind = kKinds[below(3)];
      const bool optimizer = below(2) == 0, async = below(4) != 0;
      SCOPED_TRACE(absl::StrCat("save ", CheckpointKindName(kind), optimizer ? " with" : " without", " optimizer state",
                                async ? ", async" : ""));
      const absl::Status saved = client_->SaveCheckpoint(name, kind, optimizer, async);
      if (complete.count(name) != 0 || pending.count(name) != 0) {
        EXPECT_TRUE(absl::IsAlreadyExists(saved)) << saved;
        overlapped += pending.count(name);
        continue;
      }
      ASSERT_TRUE(saved.ok()) << saved;
      (async ? pending : complete)[name] = {version_, Params()};
    } else if (choice < 14) {
      SCOPED_TRACE("load");
      const absl::Status loaded = client_->LoadCheckpoint(name);
      const bool committed = complete.count(name) != 0;
      if (pending.count(name) != 0 && absl::IsNotFound(loaded)) {
        ++overlapped;
        continue;
      }
      if (!committed && pending.count(name) == 0) {
        EXPECT_TRUE(absl::IsNotFound(loaded)) << loaded;
        continue;
      }
      ASSERT_TRUE(loaded.ok()) << loaded;
      if (!committed) complete.insert(pending.extract(name));
      version_ = complete.at(name).version;
      ExpectParams(complete.at(name));
    } else if (choice < 16) {
      SCOPED_TRACE("delete");
      const absl::Status deleted = client_->DeleteCheckpoint(name);
      if (pending.count(name) != 0) {
        // Refused while any server still writes it; once committed, it goes.
        if (absl::IsFailedPrecondition(deleted)) {
          ++overlapped;
          continue;
        }
        EXPECT_TRUE(deleted.ok()) << deleted;
        pending.erase(name);
      } else {
        EXPECT_EQ(deleted.code(), complete.erase(name) != 0 ? absl::StatusCode::kOk : absl::StatusCode::kNotFound)
            << deleted;
      }
    } else if (choice < 18) {
      SCOPED_TRACE("list");
      auto entries = client_->ListCheckpoints();
      ASSERT_TRUE(entries.ok()) << entries.status();
      check_listing(*entries);
    } else if (choice < 19) {
      SCOPED_TRACE("wait for every save");
      std::set<std::string> expected;
      for (const auto* saves : {&complete, &pending}) {
        for (const auto& [saved_name, saved] : *saves) expected.insert(saved_name);
      }
      EXPECT_EQ(CompleteCheckpoints(), expected);
      complete.merge(pending);
    } else {
      SCOPED_TRACE("export");
      const std::string dir = absl::StrCat(exports_.path(), "/", op);
      const absl::Status exported = client_->ExportStateDict(dir, CheckpointKind::kFull, below(2) == 0);
      ASSERT_TRUE(exported.ok()) << exported;
    }
  }
  // Every accepted save commits, holding the cut it was asked for.
  SCOPED_TRACE(absl::StrCat("seed ", seed, ", at the end"));
  (void)CompleteCheckpoints();
  auto entries = client_->ListCheckpoints();
  ASSERT_TRUE(entries.ok()) << entries.status();
  check_listing(*entries);
  EXPECT_TRUE(pending.empty()) << pending.size() << " accepted saves never committed";
  for (const auto& [name, saved] : complete) {
    SCOPED_TRACE(absl::StrCat("load '", name, "'"));
    const absl::Status loaded = client_->LoadCheckpoint(name);
    ASSERT_TRUE(loaded.ok()) << loaded;
    version_ = saved.version;
    ExpectParams(saved);
  }
  RecordProperty("overlapped", overlapped);
}

}  // namespace
}  // namespace flatshard
