// The flatshard client library: what a training worker links to gather full parameters
// and scatter gradients (DESIGN.md, "The training step").
//
// A Client talks to every server of the cluster: gRPC for control, TCP data connections
// for bytes. Gather and Scatter return futures so a worker can prefetch the next group
// while computing on this one; at most `max_in_flight` transfers run per server at once
// (FSDP's limit_all_gathers). Bytes land straight in the caller's buffers, which must
// stay valid until the future is ready. All methods are thread-safe. Destroying a Client
// cancels its transfers in flight (those still connecting to a server included) and
// waits for them to let go of their buffers: the futures it returned become ready,
// Cancelled unless they were done (a scatter cut after its last byte reached a server
// may still count there), and stay valid, whether or not they were waited for first.
// The calls that take a std::stop_token (all but the checkpoint calls, which
// CancelCheckpointCalls reaches) end at once, Cancelled, when its std::stop_source is
// asked to stop from another thread (a Ctrl-C handler, say), also against a server that
// stopped answering; a stopped call may have taken effect on some servers, as one that
// timed out, and may be made again (Gather and Scatter say what a stop does to them).
//
//   auto client = flatshard::Client::Connect({.servers = {"127.0.0.1:7070"}, .num_workers = 2});
//   (*client)->ConfigureJob({});
//   auto layout = (*client)->RegisterGroup("mlp", tensors, 0, flatshard::AdamOptions{.lr = 1e-3});
//   std::vector<float> params((*layout)->padded_numel());
//   auto version = (*client)->Gather("mlp", 0, flatshard::DType::kFloat32, AsBytes(params)).get();
#ifndef FLATSHARD_CLIENT_INCLUDE_FLATSHARD_CLIENT_H_
#define FLATSHARD_CLIENT_INCLUDE_FLATSHARD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <stop_token>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/checkpoint_kind.h"
#include "core/dtype.h"
#include "core/layout.h"

namespace flatshard {

// How device (GPU) buffers reach a --memory=device server (host buffers always use TCP):
//   kAuto     CUDA IPC when the server's shards are on the buffer's GPU, NCCL when they
//             are on another GPU or node (and NCCL loads on both sides), else TCP
//             through host staging;
//   kCudaIpc  CUDA IPC where possible, else TCP;
//   kNccl     NCCL where the server has it, even on the buffer's own GPU (NCCL refuses
//             two ranks on one GPU unless their NCCL_HOSTID differ: for tests and
//             comparisons), else TCP;
//   kTcp      always TCP through host staging.
enum class DevicePlane { kAuto, kCudaIpc, kNccl, kTcp };

struct ClientOptions {
  std::vector<std::string> servers = {};  // control addresses in rank order (as --cluster)
  std::string token = {};                 // the cluster's shared token; empty: none
  int worker_rank = 0;
  int num_workers = 1;
  std::string job = "default";
  // Per RPC, per transfer, per version wait (a checkpoint's wait for its cut included).
  absl::Duration timeout = absl::Seconds(30);
  // Calls whose work grows with the model, as a whole: RegisterGroup and
  // InitGroupFromSeed (every server allocates, zeroes or fills the group's memory),
  // SaveCheckpoint, LoadCheckpoint and ExportStateDict (they move all of it); `timeout`
  // does not bound them. None by default; a server that dies or hangs meanwhile fails
  // them within twice `keepalive`.
  absl::Duration model_timeout = absl::InfiniteDuration();
  // While calls are in flight, each server is pinged this often (at least 1 s) and must
  // answer within as long again; otherwise its calls fail with UNAVAILABLE.
  absl::Duration keepalive = absl::Seconds(15);
  int max_in_flight = 2;                       // concurrent transfers per server, 1-64
  uint32_t export_chunk_bytes = 4 << 20;       // ExportStateDict: bytes per message (<= 64 MiB)
  DevicePlane device_plane = DevicePlane::kAuto;
  // A gather into host memory whose part from one server has at least this many bytes
  // comes in up to max_in_flight ranges over that server's connections at once (each at
  // least half this size): one TCP stream is CPU-bound on each side. 0: never split.
  int64_t gather_split_bytes = 16 << 20;
  // Likewise for a scatter from host memory: its part for one server goes in up to
  // max_in_flight pieces at once, which that server takes together. 0: never split.
  int64_t scatter_split_bytes = 16 << 20;
  // PEM CA bundle the servers' certificates are checked against: the control plane then
  // speaks TLS (servers started with --tls_cert_file). Empty: plaintext gRPC.
  std::string tls_ca_file = {};
  // PEM certificate (chain) and private key this client presents to servers that ask
  // for one (started with --tls_client_ca_file): both or neither, and with tls_ca_file.
  std::string tls_cert_file = {};
  std::string tls_key_file = {};
  // How often the TLS files are read again, so that connections made later (a
  // reconnection after an idle spell or a server's restart) trust a CA added to
  // tls_ca_file since, as in a CA rotation, and present a renewed client certificate;
  // files that do not parse, or a key that is not the certificate's, are ignored. Zero:
  // read once, at Connect.
  absl::Duration tls_reload_interval = absl::Minutes(5);
};

struct JobOptions {
  bool reduce_mean = true;   // false: sum
  double max_grad_norm = 0;  // 0: no clipping (clip_grad_norm_ over all groups of the job)
  double norm_type = 2.0;    // 2 or infinity
  // Asynchronous (parameter-server) mode: each contribution is applied on arrival; its
  // `step` is the version the gradient was computed from. Contributions more than
  // max_staleness versions old are refused (< 0: no bound).
  bool async = false;
  int64_t max_staleness = -1;
  // Hybrid sharding (FSDP's HYBRID_SHARD): the N servers form this many replica groups
  // of N / replicas consecutive ranks; every group is sharded over one replica group and
  // replicated across them. Worker w gathers from and scatters to replica group
  // w % replicas only, and the servers add up the replica groups' gradients among
  // themselves. Must divide N, be at most num_workers, and needs sync mode.
  int replicas = 1;
  // Sync mode: a step whose reduced gradient holds inf or NaN (one bad batch, an fp16
  // overflow) is skipped on every server: the version advances, parameters and optimizer
  // state stay, as torch's GradScaler skips optimizer.step(). GradNorm(step) is then inf
  // or NaN, which is how a worker learns it (to lower a loss scale, say).
  bool skip_nonfinite = false;
};

struct SgdOptions {
  double lr = 1e-2;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool amsgrad = false;
  bool decoupled_weight_decay = false;  // true: AdamW
};

// Parameters that are never trained (torch: requires_grad=False). The servers keep no
// gradient or optimizer state for the group and refuse scatters to it; Gather, InitGroup,
// checkpoints and export work as for any group. Its version stays 0 unless a checkpoint
// load sets it.
struct FrozenOptions {};

// Module buffers (torch's BatchNorm running statistics), which each worker updates in its
// forward: each step the group's values become the mean of what the workers scatter,
// whatever the job's reduce, outside gradient clipping and the skipping of non-finite
// steps (a skipped step still takes them, as torch's forward has updated them). The
// servers keep no optimizer state; checkpoints and export hold the values as any
// group's. SYNC jobs only (registration in an ASYNC job is InvalidArgument).
struct AverageOptions {};

using OptimizerOptions = std::variant<SgdOptions, AdamOptions, FrozenOptions, AverageOptions>;

// A group's new optimizer settings (Client::SetHyperparams).
struct GroupOptimizer {
  std::string group;
  OptimizerOptions optimizer;
};

// One group's initial values (Client::InitGroups): as InitGroup's `flat`, which must
// stay valid until the call returns.
struct GroupValues {
  std::string group;
  absl::Span<const float> flat;
};

// A group to register (Client::RegisterGroups).
struct GroupSpec {
  std::string group;
  std::vector<TensorSpec> tensors;
  int64_t align = 0;
  OptimizerOptions optimizer;
};

// What a non-strict load (Client::LoadCheckpointNonStrict) left out, as torch's
// load_state_dict(strict=False) reports it.
struct IncompatibleTensors {
  std::vector<std::string> missing;     // registered, not in the checkpoint: kept as they were
  std::vector<std::string> unexpected;  // in the checkpoint, registered by no group: not loaded
};

// What Client::ImportCheckpoint brought into the cluster.
struct ImportedCheckpoint {
  CheckpointKind kind = CheckpointKind::kFull;  // of the files, and so of the checkpoint
  uint64_t bytes = 0;               // of the files sent
  std::vector<std::string> groups;  // the checkpoint's groups, as server 0 described the files
  bool optimizer = false;           // whether it holds optimizer state
};

struct CheckpointEntry {
  std::string name;
  bool complete = false;  // false: a save that did not finish (never loadable)
  std::string kind;
  std::string job;
  int servers = 0;
  bool optimizer = false;
  int64_t bytes = 0;
  std::map<std::string, int64_t> versions;  // group -> version saved
};

// Where a save or export cuts the groups that the job trains (SaveCheckpoint,
// ExportStateDict). Frozen groups are cut at their version, which does not move.
class CutAt {
 public:
  enum class Kind { kDefault, kStepBoundary, kVersion };

  // The default, which SaveCheckpoint describes.
  CutAt() = default;
  // Every trained group at the highest version any of them has reached, the others
  // waited for: the end of the step in progress (now, between steps). For a client that
  // sends no gradients (an operator's save, a remote export) while workers train, where
  // the job's trained groups step together (registered together and trained every step,
  // as ShardedModule's are). FailedPrecondition where their versions are more than one
  // apart (they do not step together), for an async job (each gradient steps on its
  // own), and from a worker inside a step (the cut would wait for its own gradients).
  static CutAt StepBoundary() { return CutAt(Kind::kStepBoundary, 0); }
  // Every trained group at `version` (the state after that many steps), waiting for
  // training to get there; FailedPrecondition naming a group already past it.
  static CutAt Version(int64_t version) { return CutAt(Kind::kVersion, version); }

  Kind kind() const { return kind_; }
  int64_t version() const { return version_; }  // kVersion's

 private:
  CutAt(Kind kind, int64_t version) : kind_(kind), version_(version) {}

  Kind kind_ = Kind::kDefault;
  int64_t version_ = 0;
};

class Client {
 public:
  // Connects to every server, checks that each one believes in the same cluster (same
  // address list, its rank = its index) and opens the data connections. Unavailable if a
  // server cannot be reached, FailedPrecondition on a cluster mismatch, Unauthenticated
  // on a wrong token.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  virtual ~Client() = default;

  virtual const ClientOptions& options() const = 0;
  int num_servers() const { return static_cast<int>(options().servers.size()); }

  // Idempotent on every server: each worker may send the same settings.
  [[nodiscard]] virtual absl::Status ConfigureJob(const JobOptions& job, std::stop_token stop = {}) = 0;
  // When training is over: deletes the job (ClientOptions::job) on every server, with its
  // groups, their memory and its norms. The servers keep a job until then, and refuse
  // other settings under its name. Requests of its workers then fail with NotFound,
  // waits included; the name may be configured again, with any settings. Returns the
  // bytes the servers held for it (freed as the requests still using them end). NotFound
  // when no server had the job; a server that no longer had it (a retry) counts as done.
  [[nodiscard]] virtual absl::StatusOr<int64_t> DeleteJob(std::stop_token stop = {}) = 0;

  // Registers (or finds the identical) group on every server and returns its layout over
  // the cluster (over one replica group's N / replicas servers for a hybrid-sharded job);
  // the pointer stays valid for the Client's lifetime.
  [[nodiscard]] absl::StatusOr<const FlatLayout*> RegisterGroup(const std::string& group,
                                                                std::vector<TensorSpec> tensors, int64_t align,
                                                                const OptimizerOptions& optimizer,
                                                                std::stop_token stop = {}) {
    std::vector<GroupSpec> groups;
    groups.push_back({group, std::move(tensors), align, optimizer});
    absl::StatusOr<std::vector<const FlatLayout*>> layouts = RegisterGroups(std::move(groups), std::move(stop));
    if (!layouts.ok()) return layouts.status();
    return layouts->front();
  }
  // The same for several groups (every group of a model) in one call per server, server
  // 0 first, then the others at once; the layouts come in `groups`' order. A server
  // registers all of a call's groups or none: InvalidArgument (a malformed spec, a name
  // given twice), AlreadyExists (a spec that differs from a registered group's) and
  // ResourceExhausted (memory) name the group (InvalidArgument for no group at all). A
  // server after server 0 that refuses leaves the groups on those before it, as a single
  // group's registration does: registering again finds them. Specs of more than about
  // 1 MiB go in several calls, each all or none.
  [[nodiscard]] virtual absl::StatusOr<std::vector<const FlatLayout*>> RegisterGroups(std::vector<GroupSpec> groups,
                                                                                      std::stop_token stop = {}) = 0;

  // Pushes initial values: `flat` holds unpadded_numel() or padded_numel() fp32 values in
  // flat-layout order (see Flatten in core/flat_buffer.h); padding is ignored. Each
  // server's shard goes straight from `flat` (no copy of the model is made). A stop ends
  // the pushes at once (a server that had not received all of its shard keeps its
  // values), the opening of their connections included.
  [[nodiscard]] absl::Status InitGroup(const std::string& group, absl::Span<const float> flat,
                                       std::stop_token stop = {}) {
    return InitGroups({{group, flat}}, std::move(stop));
  }
  // The same for several groups (a model's), every push in flight at once rather than a
  // round trip per group. Blocks until all have ended. Every group's values are checked
  // before anything is sent (InvalidArgument naming the group); after that, the first
  // failure in `groups`' order is returned, naming its group, the other groups having
  // been pushed or not as they would alone (pushing again is allowed before the first
  // step).
  [[nodiscard]] virtual absl::Status InitGroups(const std::vector<GroupValues>& groups,
                                                std::stop_token stop = {}) = 0;
  // Deterministic initialization on the servers, independent of the server count.
  [[nodiscard]] virtual absl::Status InitGroupFromSeed(const std::string& group, uint64_t seed,
                                                       std::stop_token stop = {}) = 0;

  // Fills `out` (padded_numel() elements of `dtype`) with the parameters at a version
  // >= min_version and returns that version (the lowest one any server sent).
  // `group` must have been registered by this Client. `out` (and Scatter's `grad`) may
  // be host memory or, in a CUDA build, device memory from cudaMalloc: then
  // --memory=device servers move the bytes by CUDA IPC (on the same GPU) or NCCL (on
  // another), the others over TCP through a host copy (ClientOptions::device_plane,
  // DataPlanes() says which). The servers and NCCL read and write a device buffer from
  // their own CUDA streams, so the buffer must be ready when the call is made:
  // the GPU work that writes `grad`, or still reads `out`, complete (synchronize its
  // stream; a pageable cudaMemcpy to the device may return before its bytes land).
  // Until the future is ready the buffer is the servers'; after, `out` holds the bytes.
  // Aborted when the servers answered from the states of two checkpoint loads (one was
  // committing, or did not commit everywhere): gather again. The Client remembers which
  // load the gathered state came from, for this group's next Scatter.
  // A stop asked of `stop` ends the transfer, Cancelled, the wait for min_version
  // included: over TCP and NCCL at once (the requests not yet sent are not sent, the
  // connections of those under way are shut down, and an NCCL link being opened or an
  // NCCL operation under way is aborted); over CUDA IPC, where the servers move the bytes
  // themselves, once none of them still touches the buffer (a server that stopped
  // waiting at the stop, or finished its copy). The future is then ready and the buffer
  // the caller's again; a stopped gather's `out` may hold part of the bytes.
  virtual std::future<absl::StatusOr<int64_t>> Gather(const std::string& group, int64_t min_version, DType dtype,
                                                      absl::Span<std::byte> out, std::stop_token stop = {}) = 0;

  // Sends this worker's full flat gradient (padded_numel() elements of `dtype`) for
  // `step`: each server receives its slice. Ready once every server holds it; it does
  // not wait for the other workers. Sent again after a failure, it is AlreadyExists when
  // every server already held or applied it (the servers that lacked it take it), and
  // any other error when one still failed. The gradient names the checkpoint load of
  // this group's last Gather (or InitGroup): Aborted when a load replaced that state since
  // (even at the same version): gather the loaded state and compute the gradient again.
  // Without a Gather or InitGroup of the group by this Client, it is not checked.
  // A stop ends it as it ends a Gather; a server that had received all of the gradient
  // before the stop may have taken it (send it again: AlreadyExists there), the others
  // drop what they had received.
  virtual std::future<absl::Status> Scatter(const std::string& group, int64_t step, DType dtype,
                                            absl::Span<const std::byte> grad, std::stop_token stop = {}) = 0;

  // Gather (Scatter) of several groups at once: groups[i] into outs[i] (from grads[i]),
  // each as the call for one group moves it, with a future each in `groups`' order (a
  // group that is not registered gets its error there). Where a group's share of a server
  // is small (host memory, 64 KiB at most: a model of many small layers), its request
  // goes to the server with others' in one write on one connection and their answers are
  // read in order: one round trip per 16 such groups instead of one each (bench/RESULTS.md,
  // "Pipelined transfers of many small groups"). One stop ends all of them.
  virtual std::vector<std::future<absl::StatusOr<int64_t>>> GatherGroups(const std::vector<std::string>& groups,
                                                                          int64_t min_version, DType dtype,
                                                                          const std::vector<absl::Span<std::byte>>& outs,
                                                                          std::stop_token stop = {}) = 0;
  virtual std::vector<std::future<absl::Status>> ScatterGroups(const std::vector<std::string>& groups, int64_t step,
                                                               DType dtype,
                                                               const std::vector<absl::Span<const std::byte>>& grads,
                                                               std::stop_token stop = {}) = 0;

  // Per server, the data plane a device buffer on this thread's current GPU would use:
  // "cuda-ipc", "nccl" or "tcp" (see DevicePlane). Host buffers always use "tcp".
  virtual std::vector<std::string> DataPlanes() const = 0;

  // Waits until every server's shard of `group` (of this worker's replica group) reaches
  // min_version. Here and in Gather: Aborted, at once, when a checkpoint load sets the
  // group below min_version while the call waits (the load dropped the gradients sent
  // for the step in progress); the message names the version loaded.
  // A stopped wait (here and in GradNorm) says what it waited for. When every server
  // answered this Client's latest Scatter of the group, for step min_version - 1, with
  // min_version (its gradient completed the step there), it returns min_version without
  // asking them again: a load after those answers shows in the next Gather instead.
  [[nodiscard]] virtual absl::StatusOr<int64_t> WaitVersion(const std::string& group, int64_t min_version,
                                                            std::stop_token stop = {}) = 0;

  // WaitVersion for several groups in one call per server (a step's groups: one round
  // trip rather than one per group): their versions, in `groups`' order. InvalidArgument
  // for no group; NotFound naming a group the servers do not have, before any wait.
  [[nodiscard]] virtual absl::StatusOr<std::vector<int64_t>> WaitVersions(const std::vector<std::string>& groups,
                                                                          int64_t min_version,
                                                                          std::stop_token stop = {}) = 0;

  // The job's total gradient norm at `step`, before clipping (what
  // torch.nn.utils.clip_grad_norm_ returns), for logging; waits until the step is
  // reduced. The job must clip or skip non-finite steps (JobOptions::max_grad_norm,
  // skip_nonfinite): InvalidArgument otherwise. NotFound for a step more than 1024 steps
  // old.
  [[nodiscard]] virtual absl::StatusOr<double> GradNorm(int64_t step, std::stop_token stop = {}) = 0;

  // New hyper-parameters from the next step on (same optimizer kind as registered).
  [[nodiscard]] absl::Status SetHyperparams(const std::string& group, const OptimizerOptions& optimizer,
                                            std::stop_token stop = {}) {
    return SetHyperparams(std::vector<GroupOptimizer>{{group, optimizer}}, std::move(stop));
  }
  // The same for several groups in one request per server (server 0 first, then the
  // others at once: a learning-rate schedule's change to every group), carried on the
  // data connections, whose round trip is a fraction of a gRPC call's. Each server finds
  // every group and checks its settings before it changes any: NotFound, InvalidArgument
  // (a setting out of range) or FailedPrecondition (another optimizer kind) naming the
  // group change nothing there; InvalidArgument for no group. Only memory for state the
  // new settings need (momentum, amsgrad) can still run out part-way (ResourceExhausted
  // naming the group), leaving the groups before it changed.
  [[nodiscard]] virtual absl::Status SetHyperparams(const std::vector<GroupOptimizer>& groups,
                                                    std::stop_token stop = {}) = 0;

  // Progress of a save, load or export: the bytes done and the total known so far (it
  // grows while servers start). Called from a thread of the client's, one call at a time;
  // once every server is done (before a save's or load's commit), a last time with
  // bytes_done == bytes_total, if it was called before.
  using Progress = std::function<void(uint64_t bytes_done, uint64_t bytes_total)>;

  // Saves every group of the job at its current version (a consistent cut: each server
  // saves exactly that version), in parallel on all servers, then commits atomically.
  // Every server pins the cut before any writes; where training moves past it on a
  // server first, a later cut is pinned (Aborted after 10 tries). From a worker between
  // steps (it has sent as many steps of every group it trains), each group is cut after
  // the step this worker sent last, waiting where the other workers have not completed
  // it: a save right after a step (its Scatter futures ready) holds the state after that
  // step (DeadlineExceeded if a worker never sends its part). Where no server holds the
  // gradient this worker sent (a checkpoint load dropped it), nothing is waited for.
  // From any other client, or inside a step, the cut is at the versions now, which while
  // workers train may fall inside a step (not in a job that clips or skips non-finite
  // steps, whose groups step together: the cut waits for those finishing the step):
  // `at` chooses another cut (CutAt), such as the end of the step in progress.
  // With a root shared by all servers, each writes its own part there; where the roots
  // differ, FULL and SHARDED are kept in server 0's root and LOCAL in each server's own.
  // `async`: returns once every server has snapshotted its shards (training may
  // continue); the checkpoint lists as complete when the servers have written and
  // committed it. `progress` (optional; blocking saves): the servers' tensor bytes
  // written, polled from their status a few times a second. AlreadyExists if `name` is
  // complete or a save of it is still in progress (a blocking one until it is committed;
  // one save per name at a time: of several callers saving one name at once, exactly one
  // succeeds).
  [[nodiscard]] virtual absl::Status SaveCheckpoint(const std::string& name, CheckpointKind kind, bool optimizer,
                                                    bool async = false, Progress progress = nullptr, CutAt at = {}) = 0;
  // Loads a checkpoint into the job's registered groups on every server: all servers
  // verify and stage it first; if any refuses (damage, mismatch), none changes. FULL and
  // SHARDED checkpoints load by tensor name, also into groups other than the saved ones
  // (each group from groups saved at one step; every saved tensor must find a group);
  // LOCAL ones into the same groups only. `progress` (optional): the servers' tensor
  // bytes read, as for saves.
  [[nodiscard]] virtual absl::Status LoadCheckpoint(const std::string& name, Progress progress = nullptr) = 0;
  // As LoadCheckpoint, but loads what the checkpoint and the registered groups have in
  // common (torch's load_state_dict(strict=False): fine-tuning from a checkpoint of
  // another model): a registered tensor the checkpoint lacks keeps its values and
  // optimizer state, a checkpoint tensor no group registers is skipped, and both are
  // returned. A group takes the saved version and optimizer step count of the tensors it
  // loads (one count per group: a kept tensor's Adam bias correction follows it); a
  // trained group the checkpoint holds nothing of keeps its step count and takes the
  // version of the loaded trained groups (when they agree), so the job steps on together;
  // a frozen one stays as it is. A tensor saved with another shape or dtype is refused as
  // by LoadCheckpoint; LOCAL checkpoints load only the groups they hold, each as saved.
  [[nodiscard]] virtual absl::StatusOr<IncompatibleTensors> LoadCheckpointNonStrict(const std::string& name,
                                                                                    Progress progress = nullptr) = 0;
  [[nodiscard]] virtual absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(std::stop_token stop = {}) = 0;
  // Removes checkpoint `name`, complete or not (an interrupted save). NotFound if there
  // is none; FailedPrecondition while a save of it is still being written.
  [[nodiscard]] virtual absl::Status DeleteCheckpoint(const std::string& name, std::stop_token stop = {}) = 0;
  // Streams a FULL (model.safetensors [+ optimizer.safetensors]) or SHARDED
  // (shard-<rank>.safetensors) state dict of the job from every server at once into the
  // directory `out_dir` on this machine (created if missing). Memory stays bounded by a
  // few chunks (ClientOptions::export_chunk_bytes) per server, whatever the model size.
  // The cut is chosen as for SaveCheckpoint, `at` included (pinned on every server
  // before any streams). `progress` (optional): the bytes written here so far and the
  // total announced so far.
  [[nodiscard]] virtual absl::Status ExportStateDict(const std::string& out_dir, CheckpointKind kind, bool optimizer,
                                                     Progress progress = nullptr, CutAt at = {}) = 0;
  // The reverse of ExportStateDict: streams the state dict in the directory `in_dir` on
  // this machine to server 0, which checks it and commits it as checkpoint `name` in its
  // root, as a save is. LoadCheckpoint (or LoadCheckpointNonStrict) then loads it into
  // any server count, by tensor name. FULL: what an export writes, or model.safetensors
  // as PyTorch or Hugging Face tools write it, split with its index or not (with
  // `optimizer`, the optimizer files beside it too); the groups are those the optimizer
  // file's metadata describes (an export's: each with its version and optimizer steps),
  // and a file without optimizer state is one group at `version`, whose optimizer starts
  // afresh at a load. SHARDED: a SHARDED export's shard files, a SHARDED checkpoint of the
  // exported groups (their optimizer state only with `optimizer`). Memory stays bounded
  // by a chunk (ClientOptions::export_chunk_bytes); `progress` counts the bytes sent.
  // NotFound when `in_dir` has no model or shard file; InvalidArgument (from server 0,
  // naming what is wrong) for files that are not a state dict; AlreadyExists if `name`
  // exists. A failed or cancelled import leaves nothing on the servers.
  [[nodiscard]] virtual absl::StatusOr<ImportedCheckpoint> ImportCheckpoint(const std::string& name,
                                                                            const std::string& in_dir,
                                                                            bool optimizer = true,
                                                                            int64_t version = 0,
                                                                            Progress progress = nullptr) = 0;
  // Cancels this client's SaveCheckpoint, LoadCheckpoint, ExportStateDict and ImportCheckpoint calls in
  // progress (from another thread, or from their progress callbacks); calls made later are
  // not affected. Each returns CANCELLED soon after, its servers having stopped and kept
  // nothing of it: no save is committed (its files go), no load installed, no export file
  // named. A call already committing goes to its end.
  virtual void CancelCheckpointCalls() = 0;
};

// Views a typed buffer as bytes, for Gather and Scatter.
template <typename T>
absl::Span<std::byte> AsBytes(std::vector<T>& values) {
  return absl::MakeSpan(reinterpret_cast<std::byte*>(values.data()), values.size() * sizeof(T));
}
template <typename T>
absl::Span<const std::byte> AsBytes(const std::vector<T>& values) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(values.data()),
                             values.size() * sizeof(T));
}

}  // namespace flatshard

#endif  // FLATSHARD_CLIENT_INCLUDE_FLATSHARD_CLIENT_H_
