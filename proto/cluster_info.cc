#include "proto/cluster_info.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard {

absl::string_view FlatshardVersion() { return FLATSHARD_VERSION; }

absl::Status CheckClusterInfo(const v1::ClusterInfo& info, const std::vector<std::string>& cluster, int rank,
                              absl::string_view caller) {
  const std::string& address = cluster.at(rank);
  if (info.protocol() != kProtocolRevision) {
    // An older server leaves the field out (0).
    return absl::FailedPreconditionError(absl::StrCat(
        "server ", address, " speaks flatshard protocol revision ", info.protocol(), " (flatshard ",
        info.version().empty() ? "of unknown version" : info.version(), "); ", caller, " speaks revision ",
        kProtocolRevision, " (flatshard ", FlatshardVersion(), "): run clients and servers of one release"));
  }
  const std::vector<std::string> theirs(info.cluster().begin(), info.cluster().end());
  if (theirs != cluster || info.rank() != rank) {
    return absl::FailedPreconditionError(absl::StrCat("server ", address, " is rank ", info.rank(), " of cluster [",
                                                      absl::StrJoin(theirs, ","), "]; ", caller, " expects rank ", rank,
                                                      " of [", absl::StrJoin(cluster, ","), "]"));
  }
  return absl::OkStatus();
}

}  // namespace flatshard
