#include "client/cli/status_command.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cli/human_bytes.h"
#include "client/cli/latency_table.h"
#include "client/cluster_status.h"
#include "client/device_memory.h"
#include "client/nccl_link.h"

namespace flatshard::cli {

namespace {

// `flatshard status` warns of certificates that expire sooner than this.
constexpr absl::Duration kTlsExpiryWarning = absl::Hours(7 * 24);

// How long a server's TLS certificate has left, as the table's tls column shows it: "no"
// without TLS, hours under two days, days beyond, "expired"; then "+mtls" when it asks
// callers for certificates, and "+data" when its data plane speaks TLS too.
std::string TlsLeft(const v1::ServerStatus& s, absl::Time now) {
  if (!s.tls()) return "no";
  const absl::Duration left = absl::FromUnixSeconds(s.tls_expiry_unix_seconds()) - now;
  const std::string mutual = absl::StrCat(s.tls_client_certificates() ? "+mtls" : "", s.data_tls() ? "+data" : "");
  if (left <= absl::ZeroDuration()) return "expired" + mutual;
  if (left < absl::Hours(48)) return absl::StrCat(absl::ToInt64Hours(left), "h", mutual);
  return absl::StrCat(absl::ToInt64Hours(left) / 24, "d", mutual);
}

// A group's load id as the table shows it: hex, "-" for a group never loaded.
std::string LoadName(uint64_t load_id) { return load_id == 0 ? "-" : absl::StrCat(absl::Hex(load_id)); }

// One line per group whose servers hold the states of different checkpoint loads: a load
// that committed on some servers only (its client said which), or a server restarted
// since the last load.
void ReportSplitLoads(const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses, std::ostream& out) {
  std::map<std::string, std::map<uint64_t, std::vector<int>>> ranks;  // job/group -> load id -> ranks
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::GroupStatus& g : status->groups())
      ranks[g.job() + "/" + g.group()][g.load_id()].push_back(status->rank());
  }
  for (const auto& [group, by_load] : ranks) {
    if (by_load.size() < 2) continue;
    std::vector<std::string> parts;
    for (const auto& [load_id, holders] : by_load) {
      parts.push_back(
          absl::StrCat(LoadName(load_id), " on rank", holders.size() > 1 ? "s " : " ", absl::StrJoin(holders, ",")));
    }
    out << "\n"
        << group << ": its servers hold the states of different checkpoint loads (" << absl::StrJoin(parts, "; ")
        << "): a load did not commit on every server, or a server restarted since; load the checkpoint "
           "again\n";
  }
}

// A job's groups on every server that answered, as the jobs' table sums them up from
// the servers' summaries.
struct JobGroups {
  int groups = 0;  // the most any server holds (each holds every group of the job)
  int64_t min_version = 0;
  int64_t max_version = 0;
  int64_t bytes = 0;  // on every server
};

std::map<std::string, JobGroups> SumUpGroups(const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses) {
  std::map<std::string, JobGroups> jobs;
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::JobStatus& j : status->jobs()) {
      const v1::JobGroupsSummary& here = j.summary();
      if (here.groups() == 0) continue;
      JobGroups& job = jobs[j.job()];
      job.min_version = job.groups == 0 ? here.min_version() : std::min(job.min_version, here.min_version());
      job.max_version = job.groups == 0 ? here.max_version() : std::max(job.max_version, here.max_version());
      job.groups = std::max(job.groups, here.groups());
      job.bytes += here.bytes();
    }
  }
  return jobs;
}

// The rows of the table of groups: one per group per server that answered.
int GroupRows(const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses) {
  int rows = 0;
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::JobStatus& j : status->jobs()) rows += j.summary().groups();
  }
  return rows;
}

// Whether some job's groups hold the states of different checkpoint loads on different
// servers (or a server lacks some of them): their load digests differ.
bool LoadsDiffer(const std::vector<absl::StatusOr<v1::ServerStatus>>& statuses) {
  std::map<std::string, uint64_t> digests;
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::JobStatus& j : status->jobs()) {
      const auto [seen, first] = digests.emplace(j.job(), j.summary().load_digest());
      if (!first && seen->second != j.summary().load_digest()) return true;
    }
  }
  return false;
}

// A job's versions as its row shows them: "-" without groups, "7" when all are at 7,
// "6-7" in the middle of a step (or with groups stepped apart).
std::string VersionRange(const JobGroups& job) {
  if (job.groups == 0) return "-";
  if (job.min_version == job.max_version) return absl::StrCat(job.min_version);
  return absl::StrCat(job.min_version, "-", job.max_version);
}

}  // namespace

int RunStatusCommand(const StatusCommandOptions& options, std::ostream& out, std::ostream& err) {
  ClientOptions client_options{.servers = options.servers, .token = options.token, .timeout = options.timeout};
  options.tls.ApplyTo(client_options);
  // Each job's groups summed up by each server: enough for everything but the table of
  // groups and the groups whose servers hold different loads, which ask for the groups.
  v1::GetStatusRequest request;
  request.set_summarize_groups(true);
  request.set_omit_groups(!options.json && !options.all_groups);
  auto statuses = FetchClusterStatus(client_options, {}, request);
  const bool list_groups = options.all_groups || GroupRows(statuses) <= options.max_group_rows;
  if (request.omit_groups() && (list_groups || LoadsDiffer(statuses))) {
    request.set_omit_groups(false);
    statuses = FetchClusterStatus(client_options, {}, request);
  }
  int exit_code = 0;
  if (options.json) {
    for (const auto& status : statuses) {
      if (!status.ok()) exit_code = 1;
    }
    out << ClusterStatusJson(options.servers, statuses) << "\n";
    return exit_code;
  }
  // The data plane a GPU worker on this machine's current device would get (as
  // ClientOptions::device_plane kAuto picks): CUDA IPC to a server keeping its shards on
  // that same GPU, NCCL to one on another GPU when both sides load NCCL, TCP otherwise.
  const int device = client_internal::CurrentDevice();
  const absl::StatusOr<std::string> local_gpu =
      device >= 0 ? client_internal::DeviceUuid(device) : absl::StatusOr<std::string>("");
  auto plane = [&](const v1::ServerStatus& s) -> std::string {
    if (s.gpu_uuid().empty() || !local_gpu.ok() || local_gpu->empty()) return "tcp";
    if (*local_gpu == s.gpu_uuid()) return "cuda-ipc";
    return !s.nccl_version().empty() && client_internal::NcclLink::Available() ? "nccl" : "tcp";
  };
  // held: the memory of its groups (each group's is in the table below); busy: requests
  // it serves now, waiting ones among them, besides this command's; x-sent, x-recv:
  // a hybrid-sharded job's exchange between replica groups.
  // tls: how long the certificate it presents has left (+mtls: it asks callers for theirs;
  // +data: its data plane speaks TLS too).
  const absl::Time now = absl::Now();
  out << absl::StrFormat("%-4s %-21s %-6s %-8s %-13s %7s %6s %10s %5s %4s %10s %10s %10s %10s %8s %8s %6s\n", "rank",
                         "address", "memory", "plane", "tls", "threads", "groups", "held", "conns", "busy", "sent",
                         "received", "x-sent", "x-recv", "gathers", "scatters", "errors");
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      out << absl::StrFormat("%-4s %-21s unreachable: %s\n", "?", options.servers[i],
                             std::string(statuses[i].status().message()));
      exit_code = 1;
      continue;
    }
    const v1::ServerStatus& s = *statuses[i];
    int groups = 0;
    int64_t held = 0;
    for (const v1::JobStatus& j : s.jobs()) {
      groups += j.summary().groups();
      held += j.summary().bytes();
    }
    // This command's GetStatus is one of the RPCs in flight (none for a server older than the count).
    const int busy = s.data_requests_in_flight() + std::max(s.rpcs_in_flight() - 1, 0);
    out << absl::StrFormat("%-4d %-21s %-6s %-8s %-13s %7d %6d %10s %5d %4d %10s %10s %10s %10s %8d %8d %6d\n",
                           s.rank(), s.control_address(), s.memory(), plane(s), TlsLeft(s, now), s.compute_threads(),
                           groups, HumanBytes(held), s.open_data_connections(), busy, HumanBytes(s.bytes_sent()),
                           HumanBytes(s.bytes_received()), HumanBytes(s.exchange_bytes_sent()),
                           HumanBytes(s.exchange_bytes_received()), s.gathers(), s.scatters(), s.errors());
  }
  // A server older than job summaries answers without them: its groups count as none here.
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    const auto& jobs = status->jobs();
    if (std::any_of(jobs.begin(), jobs.end(), [](const v1::JobStatus& j) { return !j.has_summary(); })) {
      out << absl::StrFormat("\nserver %d: answered without summing up its jobs' groups (a flatshard older than this "
                             "command): the tables count none of its groups\n",
                             status->rank());
    }
  }
  // Certificates that expire within a week: past expiry, no client or peer can connect.
  for (const auto& status : statuses) {
    if (!status.ok() || !status->tls()) continue;
    const absl::Time expiry = absl::FromUnixSeconds(status->tls_expiry_unix_seconds());
    if (expiry - now >= kTlsExpiryWarning) continue;
    out << absl::StrFormat("\nserver %d: its TLS certificate %s %s: renew it (a server reads renewed files "
                           "every --tls_reload_interval)\n",
                           status->rank(), expiry <= now ? "expired" : "expires",
                           absl::FormatTime("%Y-%m-%d %H:%M UTC", expiry, absl::UTCTimeZone()));
  }
  // Calls refused for their credentials: someone holds a wrong token or certificate.
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    int64_t refused = 0;
    std::vector<std::string> methods;
    for (const v1::RpcErrorCount& error : status->rpc_errors()) {
      if (error.code() != "UNAUTHENTICATED" && error.code() != "PERMISSION_DENIED") continue;
      refused += error.count();
      methods.push_back(absl::StrCat(absl::StripPrefix(error.method(), "flatshard.v1.Flatshard/"), " ", error.count()));
    }
    if (refused == 0) continue;
    out << absl::StrFormat("\nserver %d: %d calls refused for their credentials since it started (%s): a client or "
                           "peer with a wrong token or certificate? Its log names the callers.\n",
                           status->rank(), refused, absl::StrJoin(methods, ", "));
  }
  // Jobs as the first server that answered has them (every server has the same settings,
  // and the same norms once a step is done); groups: how many the job has, versions: the
  // lowest and highest of theirs, memory: theirs on every server that answered.
  const std::map<std::string, JobGroups> job_groups = SumUpGroups(statuses);
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    out << absl::StrFormat("\n%-20s %7s %5s %8s %8s %9s %12s %8s %7s %13s %10s\n", "job", "workers", "mode",
                           "replicas", "max_norm", "skip_inf", "last_norm", "skipped", "groups", "versions", "memory");
    for (const v1::JobStatus& j : status->jobs()) {
      const std::string last =
          j.last_norm_step() < 0 ? "-" : absl::StrFormat("%.4g@%d", j.last_grad_norm(), j.last_norm_step());
      const auto groups = job_groups.find(j.job());
      const JobGroups none;
      const JobGroups& held = groups == job_groups.end() ? none : groups->second;
      out << absl::StrFormat("%-20s %7d %5s %8d %8g %9s %12s %8d %7d %13s %10s\n", j.job(), j.num_workers(),
                             j.mode(), j.replicas(), j.max_grad_norm(), j.skip_nonfinite() ? "yes" : "no", last,
                             j.skipped_steps(), held.groups, VersionRange(held), HumanBytes(held.bytes));
    }
    break;
  }
  if (exit_code != 0 && std::none_of(statuses.begin(), statuses.end(), [](const auto& s) { return s.ok(); })) {
    err << "flatshard status: no server answered\n";
    return exit_code;
  }
  // A model of many small groups would bury everything after its rows (thousands per
  // server): past max_group_rows, the jobs' table above sums them up.
  if (list_groups) {
    // shard: the shard of the group's layout this server holds; replica: its replica group
    // (hybrid sharding; 0 otherwise).
    // load: the checkpoint load its state comes from ("-": none).
    out << absl::StrFormat("\n%-4s %-28s %8s %12s %10s %10s %8s %5s %7s %16s\n", "rank", "job/group", "version",
                           "shard_numel", "memory", "optimizer", "pending", "shard", "replica", "load");
    for (const auto& status : statuses) {
      if (!status.ok()) continue;
      for (const v1::GroupStatus& g : status->groups()) {
        out << absl::StrFormat("%-4d %-28s %8d %12d %10s %10s %8d %5d %7d %16s\n", status->rank(),
                               g.job() + "/" + g.group(), g.version(), g.shard_numel(), HumanBytes(g.bytes()),
                               g.optimizer(), g.pending_contributions(), g.shard(), g.replica(),
                               LoadName(g.load_id()));
      }
    }
  } else {
    out << absl::StrFormat("\n%d rows of groups (one per group per server) not listed: the jobs' table sums them up; "
                           "--groups lists them, --json gives every field\n",
                           GroupRows(statuses));
  }
  PrintLatencyTable(statuses, list_groups, out);
  ReportSplitLoads(statuses, out);
  // Checkpoint saves and loads under way (each server's tensor bytes).
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::CheckpointProgress& p : status->checkpoints_in_progress()) {
      out << absl::StrFormat("\nserver %d: %s of checkpoint '%s': %s / %s\n", status->rank(), p.operation(),
                             p.name(), HumanBytes(static_cast<int64_t>(p.done())),
                             HumanBytes(static_cast<int64_t>(p.total())));
    }
  }
  // Loads read and waiting for their commit (a client that died between the phases
  // leaves one until its timeout).
  for (const auto& status : statuses) {
    if (!status.ok()) continue;
    for (const v1::StagedLoad& l : status->staged_loads()) {
      out << absl::StrFormat(
          "\nserver %d: checkpoint '%s' staged for job '%s' as load %s: %s, waiting %.0f s for its "
          "commit (dropped in %.0f s)\n",
          status->rank(), l.name(), l.job(), LoadName(l.load_id()), HumanBytes(static_cast<int64_t>(l.bytes())),
          l.age_seconds(), std::max(0.0, l.expires_in_seconds()));
    }
  }
  for (const auto& status : statuses) {
    if (status.ok() && status->cluster_check() != "agreed") {
      out << absl::StrFormat("\nserver %d cluster check: %s\n", status->rank(), status->cluster_check());
    }
  }
  if (exit_code != 0) err << "flatshard status: some servers did not answer\n";
  return exit_code;
}

}  // namespace flatshard::cli
