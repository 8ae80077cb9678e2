// LoadLeases (client/load_leases.h): servers that prepared are renewed at half the time
// they hold the load, the others never; a failed renewal is reported by Stop and not
// repeated; Stop does not wait for the next renewal.
#include "client/load_leases.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace flatshard::client_internal {
namespace {

// What a fake server does: hold the load for `held_for`, or refuse with `refusal`.
struct FakeServers {
  absl::Duration held_for = absl::Milliseconds(200);
  std::map<size_t, absl::Status> refusals;
  absl::Mutex mu;
  std::map<size_t, std::vector<absl::Time>> renewed ABSL_GUARDED_BY(mu);

  absl::StatusOr<absl::Duration> Renew(size_t server) {
    absl::MutexLock lock(&mu);
    renewed[server].push_back(absl::Now());
    if (auto it = refusals.find(server); it != refusals.end()) return it->second;
    return held_for;
  }
};

TEST(LoadLeasesTest, PreparedServersAreRenewedAtHalfTheirHold) {
  FakeServers servers;
  LoadLeases leases([&](size_t server) { return servers.Renew(server); });
  const absl::Time start = absl::Now();
  leases.Prepared(0, servers.held_for);
  leases.Prepared(2, servers.held_for);
  absl::SleepFor(absl::Seconds(1));
  EXPECT_TRUE(leases.Stop().ok());
  absl::MutexLock lock(&servers.mu);
  EXPECT_FALSE(servers.renewed.contains(1));  // never prepared
  for (size_t server : {size_t{0}, size_t{2}}) {
    const std::vector<absl::Time>& times = servers.renewed[server];
    // Every 100 ms for 1 s: ~9 renewals; at least 3 even on a stalled machine.
    EXPECT_GE(times.size(), 3u) << server;
    EXPECT_LE(times.size(), 10u) << server;
    absl::Time last = start;
    for (absl::Time at : times) {
      EXPECT_GE(at - last, absl::Milliseconds(95)) << "renewed before half its hold passed";
      last = at;
    }
  }
}

TEST(LoadLeasesTest, AFailedRenewalIsReportedOnceAndTheOthersGoOn) {
  FakeServers servers;
  servers.refusals[1] = absl::FailedPreconditionError("server 1: its staging was dropped");
  LoadLeases leases([&](size_t server) { return servers.Renew(server); });
  leases.Prepared(0, servers.held_for);
  leases.Prepared(1, servers.held_for);
  absl::SleepFor(absl::Milliseconds(600));
  const absl::Status stopped = leases.Stop();
  EXPECT_EQ(stopped, servers.refusals[1]);
  absl::MutexLock lock(&servers.mu);
  EXPECT_EQ(servers.renewed[1].size(), 1u);
  EXPECT_GE(servers.renewed[0].size(), 3u);
}

TEST(LoadLeasesTest, StopDoesNotWaitForTheNextRenewal) {
  FakeServers servers;
  LoadLeases leases([&](size_t server) { return servers.Renew(server); });
  leases.Prepared(0, absl::Hours(1));
  leases.Prepared(1, absl::ZeroDuration());  // holds nothing to renew
  const absl::Time start = absl::Now();
  EXPECT_TRUE(leases.Stop().ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_TRUE(leases.Stop().ok());  // again: the same
  absl::MutexLock lock(&servers.mu);
  EXPECT_TRUE(servers.renewed.empty());
}

}  // namespace
}  // namespace flatshard::client_internal
