// DataTransfers: a worker's data plane to every server of the cluster. Per server it
// holds the data connections (client/data_channel.h) and the NCCL links
// (client/link_pool.h), and it moves a gather, scatter or initial push as one request per
// server, each over the plane that pair allows: TCP for host buffers; for device
// buffers CUDA IPC (server on the buffer's GPU), NCCL (server on another GPU) or TCP
// through pooled pinned host staging (client/staging_pool.h), as
// ClientOptions::device_plane says. It also carries new optimizer settings, a small
// request a learning-rate schedule makes every step, on the same connections. Internal
// to the client library; Client::Gather, Client::Scatter and Client::SetHyperparams
// document the caller's side. Thread-safe.
//
// Per group it keeps the checkpoint load its last gather's state came from, or its last
// initial push went into (transport/data_protocol.h), and its scatters name that load: a
// server that holds another load's state refuses the gradient (Aborted) instead of
// taking a gradient of the replaced state for the loaded one. A gather whose parts come
// from different loads fails with Aborted (Completion). Per group it also keeps what the
// servers answered its latest scatter (client/scatter_answers.h).
//
//   DataTransfers transfers(options, endpoints, {open_nccl_channel, open_session});
//   auto version = transfers.Gather("mlp", 0, DType::kFloat32, per_server_slices).get();
#ifndef FLATSHARD_CLIENT_DATA_TRANSFERS_H_
#define FLATSHARD_CLIENT_DATA_TRANSFERS_H_

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/completion.h"
#include "client/data_channel.h"
#include "client/link_pool.h"
#include "client/nccl_link.h"
#include "client/scatter_answers.h"
#include "client/staging_pool.h"
#include "core/dtype.h"
#include "flatshard/client.h"
#include "transport/data_protocol.h"

namespace flatshard::client_internal {

// A request whose payload is at most this many bytes is written by the thread that makes
// it when a data connection is idle (DataChannel): it fits any socket's send buffer, so
// the write does not wait for the server.
inline constexpr size_t kWriteOnSubmitBytes = size_t{16} << 10;

// Pipelines (DataTransfers::GatherMany, ScatterMany, PushInits): a request whose part
// with one server is at most kPipelinedPartBytes (host memory) goes with others to that
// server, written back to back on one connection, their answers read in order: at most
// kMaxPipelined requests and kPipelineBytes of payloads (sent and received) per
// pipeline. The count bounds the answers the server writes while the client still
// writes (each at most ResponseHeader + kMaxMessageBytes, so 16 fit any socket's receive
// buffer), so neither side waits for the other to read.
inline constexpr size_t kPipelinedPartBytes = size_t{64} << 10;
inline constexpr size_t kPipelineBytes = size_t{256} << 10;
inline constexpr size_t kMaxPipelined = 16;

// What a client learned about one server when it connected.
struct ServerEndpoint {
  std::string address;   // control address, for messages
  DataSession session;   // from OpenSession
  std::string gpu_uuid;  // the GPU of a --memory=device server; empty otherwise
  bool nccl = false;     // the server offers the NCCL plane
};

// One server's initial values (PushInits): its shard's fp32 bytes from the caller's
// buffer, then `zero_bytes` zeros (the padding the buffer does not hold).
struct InitShard {
  absl::Span<const std::byte> values;
  size_t zero_bytes = 0;
};

// The control-plane calls the data plane makes, on server `server`.
struct ControlCalls {
  // OpenNcclChannel: hands the server `unique_id`, returns its channel; a stop ends it.
  std::function<absl::StatusOr<uint64_t>(int server, const std::string& unique_id, std::stop_token stop)>
      open_nccl_channel;
  // OpenSession: a new data session, for a server that restarted; a stop ends it.
  std::function<absl::StatusOr<DataSession>(int server, std::stop_token stop)> open_session;
};

class DataTransfers {
 public:
  // One endpoint per server in rank order; `calls` must stay callable for the object's
  // lifetime. Opens nothing yet: connections and links open on first use.
  DataTransfers(ClientOptions options, std::vector<ServerEndpoint> servers, ControlCalls calls);
  // Cancels the transfers in flight (DataChannel::Cancel: those queued are not sent, the
  // connections of those under way are shut down) and waits for them to end: the futures
  // this object returned become ready, Cancelled unless they were done, and stay valid.
  // NCCL links being joined and NCCL operations under way are aborted.
  ~DataTransfers();

  // `parts`: indexed by server rank, consecutive slices of one buffer (host or device
  // memory), each that server's shard in `dtype`, for the servers in `servers` (in
  // rank order; the others' entries are ignored: a hybrid-sharded job's worker moves its
  // buffer with its replica group only). The buffer must stay valid until the future
  // is ready. Errors name the server. A stop asked of `stop` ends the requests
  // (DataChannel::Submit), Cancelled: those on TCP and NCCL at once (StopCut::kConnection;
  // an NCCL link being joined, or an NCCL operation under way, is aborted), those whose
  // bytes a server moves in this process's GPU memory (CUDA IPC) once it has let go of
  // the buffer (StopCut::kSend).
  std::future<absl::StatusOr<int64_t>> Gather(const std::string& group, int64_t min_version, DType dtype,
                                              std::vector<absl::Span<std::byte>> parts, std::vector<int> servers,
                                              std::stop_token stop);
  std::future<absl::Status> Scatter(const std::string& group, int64_t step, DType dtype,
                                    std::vector<absl::Span<std::byte>> parts, std::vector<int> servers,
                                    std::stop_token stop);
  // One group's buffer for GatherMany and ScatterMany: `parts` as Gather's.
  struct GroupParts {
    std::string group;
    std::vector<absl::Span<std::byte>> parts;
  };
  // Gathers (scatters) of several groups under one stop, each as Gather (Scatter) moves
  // it, with a future each in `groups`' order. A group whose part with every server is
  // host memory of at most kPipelinedPartBytes (and not split) goes to each server in
  // pipelines (kMaxPipelined above): a model of many small groups takes a round trip per
  // pipeline instead of one per group and server. A stop asked of `stop` ends all of them.
  std::vector<std::future<absl::StatusOr<int64_t>>> GatherMany(const std::vector<GroupParts>& groups,
                                                                int64_t min_version, DType dtype,
                                                                const std::vector<int>& servers,
                                                                const std::stop_token& stop);
  std::vector<std::future<absl::Status>> ScatterMany(const std::vector<GroupParts>& groups, int64_t step, DType dtype,
                                                     const std::vector<int>& servers, const std::stop_token& stop);

  // A group's initial values, one shard per server (indexed by rank).
  struct GroupInit {
    std::string group;
    std::vector<InitShard> shards;
  };
  // Initial values of groups, sent from where they lie: every push is submitted at once
  // (the channels run as many at a time as they have connections; small shards go in
  // pipelines, as GatherMany's small parts). Blocks until every
  // push has ended; returns the first failure in `groups`' order (naming its group and
  // server), the other groups' pushes having ended as they would alone. A stop asked of
  // `stop` ends them at once (DataChannel::Submit), Cancelled: a server that had not
  // received all of a shard keeps its values (it drops a part-received push).
  [[nodiscard]] absl::Status PushInits(const std::vector<GroupInit>& groups, std::stop_token stop);

  // Server `server` takes new optimizer settings (kSetHyperparams: `settings` is a
  // serialized v1::SetHyperparamsRequest, held until the request ends): its answer, a
  // refusal naming the server. A stop asked of `stop` ends it as a transfer's, Cancelled.
  std::future<absl::Status> SetHyperparams(int server, std::shared_ptr<const std::string> settings,
                                           std::stop_token stop);

  // Per server, the plane a buffer on this thread's GPU would use (Client::DataPlanes).
  std::vector<std::string> PlaneNames() const;

  // What the servers answered each group's latest Scatter (ScatterMany's included): where
  // a wait for the version after a step need not ask them.
  ScatterAnswers& scatter_answers() { return answers_; }

 private:
  enum class Plane { kTcp, kCudaIpc, kNccl };
  using NcclLinks = LinkPool<NcclLink>;

  int num_servers() const { return static_cast<int>(servers_.size()); }
  // Runs `work` on a thread of its own, counted so that the destructor can wait for it.
  template <typename Work>
  void RunAside(Work work);
  // The header of a request to `group`; a scatter's names the load the group's last
  // gather or push held (RecordLoadHeld), when there was one.
  transport::RequestHeader HeaderFor(transport::DataOp op, const std::string& group, int64_t version,
                                     DType dtype) const;
  // The caller's buffer for `group` holds the state of `load_id` (a gather, a push).
  void RecordLoadHeld(const std::string& group, uint64_t load_id);
  // A scatter of `group` for `step` begins (ScatterAnswers::Begin): the hook for its
  // completion, which records what the servers answered.
  std::function<void(int64_t, uint64_t)> RecordAnswer(const std::string& group, int64_t step);
  bool IpcReachable(int server, int device) const;
  Plane PlaneFor(int server, int device, bool exportable) const;
  absl::StatusOr<std::shared_ptr<NcclLink>> OpenLink(int server, int device, const std::stop_token& stop);
  std::vector<transport::ByteRange> SplitFor(size_t bytes, int64_t split_bytes) const;
  absl::Status AtServer(int server, const absl::Status& status) const;
  // What a `op` request to server i that failed with `status` reports: Cancelled, naming
  // the transfer, after a stop asked of `stop` (whatever failed then failed because of
  // it: the connection was shut down), else `status` (AtServer).
  absl::Status RequestFailure(int server, const absl::Status& status, transport::DataOp op, const std::string& group,
                              const std::stop_token& stop) const;

  // The transfers below finish `done` once per server in `servers`.
  void HostGather(const std::string& group, int64_t min_version, DType dtype, std::vector<absl::Span<std::byte>> parts,
                  std::vector<int> servers, std::stop_token stop,
                  const std::shared_ptr<Completion<absl::StatusOr<int64_t>>>& done);
  // `on_ok` (optional) as Completion's: the lowest version over all the parts' answers (a
  // split scatter shows its step reached only if every part was answered after it).
  std::future<absl::Status> HostScatter(const std::string& group, int64_t step, DType dtype,
                                        const std::vector<absl::Span<std::byte>>& parts,
                                        const std::vector<int>& servers, const std::stop_token& stop,
                                        std::function<void(int64_t, uint64_t)> on_ok);
  template <typename Result>
  void DeviceTransfer(transport::DataOp op, const std::string& group, int64_t version, DType dtype,
                      std::vector<absl::Span<std::byte>> parts, const std::vector<int>& servers, int device,
                      const std::stop_token& stop, const std::shared_ptr<Completion<Result>>& done);
  // Returns the outcome for all of `servers` (a gather's lowest version and its load).
  transport::Response StagedTransfer(transport::DataOp op, const std::string& group, int64_t version, DType dtype,
                                     const std::vector<absl::Span<std::byte>>& parts, const std::vector<int>& servers,
                                     const std::stop_token& stop);
  std::pair<absl::StatusOr<transport::Response>, bool> NcclTransfer(int server, transport::Connection& conn,
                                                                    transport::DataOp op, const std::string& group,
                                                                    int64_t version, DType dtype,
                                                                    absl::Span<std::byte> part, int device,
                                                                    const std::stop_token& stop);
  template <typename Result>
  void SubmitNccl(const std::shared_ptr<Completion<Result>>& completion, transport::DataOp op, const std::string& group,
                  int64_t version, DType dtype, const std::vector<absl::Span<std::byte>>& parts,
                  const std::vector<int>& servers, int device, const std::stop_token& stop);
  template <typename Result>
  void SubmitIpc(const std::shared_ptr<Completion<Result>>& completion, transport::DataOp op, const std::string& group,
                 int64_t version, DType dtype, const std::vector<absl::Span<const std::byte>>& targets,
                 const std::vector<int>& servers, const std::shared_ptr<const void>& keep_alive,
                 const std::stop_token& stop);
  // One request of a pipeline: `send` then `send_tail` is its payload, `receive` its
  // answer's.
  template <typename Result>
  struct Piped {
    std::shared_ptr<Completion<Result>> completion;
    std::string group;
    absl::Span<const std::byte> send;
    absl::Span<std::byte> receive;
    absl::Span<const std::byte> send_tail;
  };
  // Whether `parts` (for `servers`) go in pipelines, given the split threshold of the op.
  bool Pipelinable(const std::vector<absl::Span<std::byte>>& parts, const std::vector<int>& servers,
                   int64_t split_bytes) const;
  // `op` requests to server i, in pipelines of kMaxPipelined and kPipelineBytes at most,
  // each finishing its completion. A stop asked of `stop` ends them as SubmitOne's.
  template <typename Result>
  void SubmitPipelines(int server, transport::DataOp op, int64_t version, DType dtype,
                       std::vector<Piped<Result>> requests, const std::stop_token& stop);
  template <typename Result>
  void SubmitPipeline(int server, transport::DataOp op, int64_t version, DType dtype,
                      std::vector<Piped<Result>> requests, const std::stop_token& stop);
  template <typename Result>
  void SubmitOne(const std::shared_ptr<Completion<Result>>& completion, int server, transport::DataOp op,
                 const std::string& group, int64_t version, DType dtype, absl::Span<const std::byte> send,
                 absl::Span<const std::byte> send_tail, absl::Span<std::byte> receive,
                 std::shared_ptr<const void> keep_alive, std::stop_token stop, StopCut cut = StopCut::kConnection);

  const ClientOptions options_;
  const std::vector<ServerEndpoint> servers_;
  const ControlCalls calls_;
  const bool nccl_loads_;  // some server offers NCCL and NCCL loads in this process
  // Asked to stop when the destructor begins: transfers fail Cancelled, NCCL waits end.
  std::stop_source destroying_;
  // Host staging for device buffers sent over TCP: as many as can be in flight at once.
  StagingPool staging_pool_;
  absl::Mutex aside_mu_;
  int aside_running_ ABSL_GUARDED_BY(aside_mu_) = 0;  // RunAside threads not yet done
  mutable absl::Mutex loads_mu_;
  // By group: the load of its last gather's or push's state (RecordLoadHeld).
  absl::flat_hash_map<std::string, uint64_t> held_loads_ ABSL_GUARDED_BY(loads_mu_);
  ScatterAnswers answers_;
  // Destroyed first (declared last): their threads finish tasks that use the rest.
  std::vector<std::unique_ptr<NcclLinks>> nccl_links_;  // per server
  std::vector<std::unique_ptr<DataChannel>> channels_;  // per server
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_DATA_TRANSFERS_H_
