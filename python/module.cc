// flatshard._native: the C++ client for Python (pybind11). A thin layer: flat buffers
// cross through the buffer protocol or DLPack (CUDA tensors) without copies, every network wait releases the
// GIL, and a failed absl::Status raises the flatshard.Error subclass for its code
// (flatshard/_errors.py). The Pythonic surface (dicts of tensors, optimizers, dtypes)
// is python/flatshard/__init__.py on top of this.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cluster_status.h"
#include "core/lock_order_checks.h"
#include "flatshard/await.h"
#include "flatshard/client.h"
#include "flatshard/while_waiting.h"
#include "proto/cluster_info.h"

namespace py = pybind11;

namespace flatshard::python {
namespace {

[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = py::module_::import("flatshard._errors")
                         .attr("from_status")(static_cast<int>(status.code()),
                                              std::string(status.message()));
  PyErr_SetObject(py::type::handle_of(error).ptr(), error.ptr());  // get_type() is deprecated in pybind11 3
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

DType ToDType(const std::string& name) { return Check(ParseDType(name)); }

CheckpointKind ToKind(const std::string& kind) { return Check(ParseCheckpointKind(kind)); }

// None or "now", "boundary", or a version (an int) -> where a save or export cuts (CutAt).
CutAt ToCut(const py::object& cut) {
  if (cut.is_none()) return CutAt();
  if (py::isinstance<py::str>(cut)) {
    const std::string name = cut.cast<std::string>();
    if (name == "now") return CutAt();
    if (name == "boundary") return CutAt::StepBoundary();
  } else if (py::isinstance<py::int_>(cut) && !py::isinstance<py::bool_>(cut)) {
    return CutAt::Version(cut.cast<int64_t>());
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat("cut must be None, 'now', 'boundary' or a version (an int), not ", std::string(py::repr(cut)))));
}

// A contiguous buffer of `bytes` bytes from any object with the buffer protocol.
py::buffer_info Buffer(const py::buffer& buffer, bool writable) {
  py::buffer_info info = buffer.request(writable);
  if (writable && info.readonly) Raise(absl::InvalidArgumentError("the output buffer is read-only"));
  int64_t expected = info.itemsize;
  for (int i = info.ndim - 1; i >= 0; --i) {
    if (info.shape[i] > 1 && info.strides[i] != expected) {
      Raise(absl::InvalidArgumentError("buffers must be C-contiguous"));
    }
    expected *= info.shape[i];
  }
  return info;
}

absl::Span<std::byte> Bytes(const py::buffer_info& info) {
  return {static_cast<std::byte*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

// DLPack (the ABI of dlpack.h, stable since v0.2): how torch hands over CPU and CUDA
// tensors (torch.utils.dlpack.to_dlpack). The capsule stays owned by its producer: it is
// kept alive until the transfer completes and freed by its own destructor.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

// The bytes of a DLPack capsule's tensor (C-contiguous, on the CPU or a CUDA device).
absl::Span<std::byte> DlpackBytes(const py::capsule& capsule) {
  if (std::string(capsule.name() ? capsule.name() : "") != "dltensor") {
    Raise(absl::InvalidArgumentError("expected an unused DLPack capsule named 'dltensor'"));
  }
  const DLTensor& t = static_cast<DLManagedTensor*>(capsule.get_pointer())->dl_tensor;
  if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDA &&
      t.device.device_type != kDLCUDAHost) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat("DLPack device type ", t.device.device_type, " is neither CPU nor CUDA")));
  }
  if (t.dtype.lanes != 1 || t.dtype.bits % 8 != 0) {
    Raise(absl::InvalidArgumentError("DLPack tensors must have whole-byte, single-lane elements"));
  }
  int64_t numel = 1, expected_stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.strides != nullptr && t.shape[i] > 1 && t.strides[i] != expected_stride) {
      Raise(absl::InvalidArgumentError("DLPack tensors must be C-contiguous"));
    }
    expected_stride *= t.shape[i];
    numel *= t.shape[i];
  }
  return {static_cast<std::byte*>(t.data) + t.byte_offset, static_cast<size_t>(numel * (t.dtype.bits / 8))};
}

// A buffer-protocol object or a DLPack capsule: its bytes, and what keeps them alive.
absl::Span<std::byte> AnyBytes(const py::object& object, bool writable) {
  if (py::isinstance<py::capsule>(object)) return DlpackBytes(object.cast<py::capsule>());
  return Bytes(Buffer(object.cast<py::buffer>(), writable));
}

using GatherFuture = std::shared_future<absl::StatusOr<int64_t>>;
using ScatterFuture = std::shared_future<absl::Status>;
using AnyFuture = std::variant<GatherFuture, ScatterFuture>;

bool Ready(const AnyFuture& future) {
  return std::visit([](const auto& f) { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; },
                    future);
}

// The buffers of transfers whose Pending was dropped before they were done (a wait()
// interrupted by Ctrl-C, the object then dropped): each stays referenced here until its
// transfer is done, so that dropping it does not wait. One per client; every call with
// the GIL held.
class Orphans {
 public:
  void Adopt(AnyFuture future, py::object buffer) {
    Reap();
    orphans_.emplace_back(std::move(future), std::move(buffer));
  }
  // Lets go of the buffers of transfers that are done.
  void Reap() {
    std::erase_if(orphans_, [](const auto& orphan) { return Ready(orphan.first); });
  }

 private:
  std::vector<std::pair<AnyFuture, py::object>> orphans_;
};

// A Gather (its version) or a Scatter (0) in flight, which `stop` (the source of the
// token it was started with) ends. The buffer stays referenced until a wait() has seen
// the transfer done, or, if this is dropped first, by the client's Orphans. wait(),
// done() and cancel() may be called any number of times, from any thread.
class Pending {
 public:
  Pending(AnyFuture future, std::stop_source stop, py::object keep, std::shared_ptr<Orphans> orphans)
      : future_(std::move(future)), stop_(std::move(stop)), keep_(std::move(keep)), orphans_(std::move(orphans)) {}
  ~Pending() {
    if (keep_ && !Ready(future_)) orphans_->Adopt(future_, std::move(keep_));
  }
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;

  // Waits (GIL released; flatshard::AwaitFor, so a small transfer is seen as it
  // completes) and returns the version; raises on failure. Python's signals are looked at
  // every 50 ms meanwhile: Ctrl-C (or another exception a signal handler raises) stops
  // the transfer (Cancel) and raises KeyboardInterrupt at once; the buffer stays
  // referenced here until the transfer has ended.
  int64_t Wait() {
    bool interrupted = false;
    {
      py::gil_scoped_release release;
      std::visit(
          [&](const auto& future) {
            for (absl::Duration spin = kAwaitSpin; !AwaitFor(future, absl::Milliseconds(50), spin);
                 spin = absl::ZeroDuration()) {
              py::gil_scoped_acquire gil;
              if (PyErr_CheckSignals() != 0) {  // its exception stays set
                interrupted = true;
                return;
              }
            }
          },
          future_);
    }
    if (interrupted) {
      Cancel();
      throw py::error_already_set();
    }
    absl::StatusOr<int64_t> result = int64_t{0};  // a scatter's
    if (const auto* gather = std::get_if<GatherFuture>(&future_)) {
      result = gather->get();
    } else if (const absl::Status& scattered = std::get<ScatterFuture>(future_).get(); !scattered.ok()) {
      result = scattered;
    }
    keep_ = py::object();
    return Check(std::move(result));
  }
  bool Done() const { return Ready(future_); }
  // Stops the transfer (Client::Gather says how soon); wait() then raises CancelledError,
  // unless it had finished.
  void Cancel() { stop_.request_stop(); }

 private:
  const AnyFuture future_;
  std::stop_source stop_;
  py::object keep_;
  const std::shared_ptr<Orphans> orphans_;
};

OptimizerOptions ToOptimizer(const py::dict& spec) {
  const std::string kind = spec["kind"].cast<std::string>();
  if (kind == "sgd") {
    return SgdOptions{.lr = spec["lr"].cast<double>(),
                      .momentum = spec["momentum"].cast<double>(),
                      .dampening = spec["dampening"].cast<double>(),
                      .weight_decay = spec["weight_decay"].cast<double>(),
                      .nesterov = spec["nesterov"].cast<bool>()};
  }
  if (kind == "adam" || kind == "adamw") {
    return AdamOptions{.lr = spec["lr"].cast<double>(),
                       .beta1 = spec["beta1"].cast<double>(),
                       .beta2 = spec["beta2"].cast<double>(),
                       .eps = spec["eps"].cast<double>(),
                       .weight_decay = spec["weight_decay"].cast<double>(),
                       .amsgrad = spec["amsgrad"].cast<bool>(),
                       .decoupled_weight_decay = kind == "adamw"};
  }
  if (kind == "frozen") return FrozenOptions{};
  if (kind == "average") return AverageOptions{};
  Raise(absl::InvalidArgumentError(absl::StrCat("optimizer kind '", kind, "'")));
}

py::dict LayoutToDict(const FlatLayout& layout) {
  py::list tensors;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const TensorSpec& spec = layout.tensor(i);
    tensors.append(py::dict(py::arg("name") = spec.fqn, py::arg("shape") = py::tuple(py::cast(spec.shape)),
                            py::arg("dtype") = std::string(DTypeName(spec.dtype)),
                            py::arg("offset") = layout.tensor_offset(i),
                            py::arg("numel") = layout.tensor_numel(i)));
  }
  return py::dict(py::arg("tensors") = tensors, py::arg("padded_numel") = layout.padded_numel(),
                  py::arg("unpadded_numel") = layout.unpadded_numel(),
                  py::arg("shard_numel") = layout.shard_numel(), py::arg("num_shards") = layout.num_shards());
}

class PyClient {
 public:
  PyClient(std::vector<std::string> servers, int worker_rank, int num_workers, std::string token, double timeout,
           std::string job, std::string device_plane, std::string tls_ca_file, int max_in_flight,
           int64_t gather_split_bytes, int64_t scatter_split_bytes, double model_timeout, double keepalive,
           double tls_reload_interval, std::string tls_cert_file, std::string tls_key_file) {
    static const std::map<std::string, DevicePlane> kPlanes = {{"auto", DevicePlane::kAuto},
                                                               {"cuda-ipc", DevicePlane::kCudaIpc},
                                                               {"nccl", DevicePlane::kNccl},
                                                               {"tcp", DevicePlane::kTcp}};
    auto plane = kPlanes.find(device_plane);
    if (plane == kPlanes.end()) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "device_plane '", device_plane, "' is not one of auto, cuda-ipc, nccl, tcp")));
    }
    ClientOptions options{.servers = std::move(servers),
                          .token = std::move(token),
                          .worker_rank = worker_rank,
                          .num_workers = num_workers,
                          .job = std::move(job),
                          .timeout = absl::Seconds(timeout),
                          .model_timeout = absl::Seconds(model_timeout),  // inf: none
                          .keepalive = absl::Seconds(keepalive),
                          .max_in_flight = max_in_flight,
                          .device_plane = plane->second,
                          .gather_split_bytes = gather_split_bytes,
                          .scatter_split_bytes = scatter_split_bytes,
                          .tls_ca_file = std::move(tls_ca_file),
                          .tls_cert_file = std::move(tls_cert_file),
                          .tls_key_file = std::move(tls_key_file),
                          .tls_reload_interval = absl::Seconds(tls_reload_interval)};
    absl::StatusOr<std::unique_ptr<Client>> client = [&] {
      py::gil_scoped_release release;
      return Client::Connect(options);
    }();
    client_ = Check(std::move(client));
  }

  // The client cancels its transfers in flight and waits for them (without the GIL: its
  // threads never take it while no checkpoint call runs, and none can run now); then the
  // buffers of those whose Pending was dropped go.
  ~PyClient() {
    {
      py::gil_scoped_release release;
      client_.reset();
    }
    orphans_->Reap();
  }
  PyClient(const PyClient&) = delete;
  PyClient& operator=(const PyClient&) = delete;

  void ConfigureJob(bool async, bool mean, double max_grad_norm, double norm_type, int64_t max_staleness,
                    int replicas, bool skip_nonfinite) {
    const JobOptions job{.reduce_mean = mean, .max_grad_norm = max_grad_norm, .norm_type = norm_type,
                         .async = async, .max_staleness = max_staleness, .replicas = replicas,
                         .skip_nonfinite = skip_nonfinite};
    Check(Stoppable([&](std::stop_token stop) { return client_->ConfigureJob(job, stop); }));
  }

  int64_t DeleteJob() {
    return Check(Stoppable([&](std::stop_token stop) { return client_->DeleteJob(stop); }));
  }

  // (tensor name, shape, dtype) and (group name, tensors, optimizer spec, align).
  using TensorTuple = std::tuple<std::string, std::vector<int64_t>, std::string>;
  using GroupTuple = std::tuple<std::string, std::vector<TensorTuple>, py::dict, int64_t>;

  // The groups' layouts, in their order.
  py::list RegisterGroups(const std::vector<GroupTuple>& groups) {
    std::vector<GroupSpec> specs;
    specs.reserve(groups.size());
    for (const auto& [name, tensors, optimizer, align] : groups) {
      GroupSpec& spec = specs.emplace_back(
          GroupSpec{.group = name, .tensors = {}, .align = align, .optimizer = ToOptimizer(optimizer)});
      for (const auto& [fqn, shape, dtype] : tensors) spec.tensors.push_back({fqn, shape, ToDType(dtype)});
    }
    const std::vector<const FlatLayout*> layouts = Check(
        Stoppable([&](std::stop_token stop) { return client_->RegisterGroups(std::move(specs), stop); }));
    py::list result;
    for (const FlatLayout* layout : layouts) result.append(LayoutToDict(*layout));
    return result;
  }

  // [(group, float32 buffer)] -> Client::InitGroups (InitGroup is one of them).
  void InitGroups(const std::vector<std::pair<std::string, py::buffer>>& groups) {
    std::vector<py::buffer_info> infos;  // hold the buffers' views until the pushes end
    std::vector<GroupValues> values;
    infos.reserve(groups.size());
    values.reserve(groups.size());
    for (const auto& [name, flat] : groups) {
      const py::buffer_info& info = infos.emplace_back(Buffer(flat, false));
      if (info.itemsize != 4 || info.format != py::format_descriptor<float>::format()) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat("initial values for group '", name, "' must be a float32 buffer")));
      }
      const auto* data = static_cast<const float*>(info.ptr);
      values.push_back({name, absl::MakeConstSpan(data, static_cast<size_t>(info.size))});
    }
    Check(Stoppable([&](std::stop_token stop) { return client_->InitGroups(values, stop); }));
  }

  void InitGroupFromSeed(const std::string& name, uint64_t seed) {
    Check(Stoppable([&](std::stop_token stop) { return client_->InitGroupFromSeed(name, seed, stop); }));
  }

  // `out` / `grad`: a buffer-protocol object (host memory) or a DLPack capsule (host or
  // CUDA memory; device memory takes the CUDA IPC or staged plane, client.h).
  std::unique_ptr<Pending> Gather(const std::string& name, int64_t min_version, const std::string& dtype,
                                  const py::object& out) {
    const absl::Span<std::byte> bytes = AnyBytes(out, true);
    orphans_->Reap();
    std::stop_source stop;
    return std::make_unique<Pending>(
        client_->Gather(name, min_version, ToDType(dtype), bytes, stop.get_token()).share(), stop, out, orphans_);
  }

  std::unique_ptr<Pending> Scatter(const std::string& name, int64_t step, const std::string& dtype,
                                   const py::object& grad) {
    const absl::Span<std::byte> bytes = AnyBytes(grad, false);
    orphans_->Reap();
    std::stop_source stop;
    return std::make_unique<Pending>(client_->Scatter(name, step, ToDType(dtype), bytes, stop.get_token()).share(),
                                     stop, grad, orphans_);
  }

  // Gathers (scatters) of several groups (Client::GatherGroups): a Pending each, in
  // `names`' order, which share one stop: cancelling one cancels them all.
  std::vector<std::unique_ptr<Pending>> GatherMany(const std::vector<std::string>& names, int64_t min_version,
                                                   const std::string& dtype, const std::vector<py::object>& outs) {
    std::vector<absl::Span<std::byte>> buffers;
    buffers.reserve(outs.size());
    for (const py::object& out : outs) buffers.push_back(AnyBytes(out, true));
    orphans_->Reap();
    std::stop_source stop;
    return Pendings(client_->GatherGroups(names, min_version, ToDType(dtype), buffers, stop.get_token()), stop, outs);
  }

  std::vector<std::unique_ptr<Pending>> ScatterMany(const std::vector<std::string>& names, int64_t step,
                                                    const std::string& dtype, const std::vector<py::object>& grads) {
    std::vector<absl::Span<const std::byte>> buffers;
    buffers.reserve(grads.size());
    for (const py::object& grad : grads) buffers.push_back(AnyBytes(grad, false));
    orphans_->Reap();
    std::stop_source stop;
    return Pendings(client_->ScatterGroups(names, step, ToDType(dtype), buffers, stop.get_token()), stop, grads);
  }

  int64_t WaitVersion(const std::string& name, int64_t min_version) {
    return Check(Stoppable([&](std::stop_token stop) { return client_->WaitVersion(name, min_version, stop); }));
  }

  std::vector<int64_t> WaitVersions(const std::vector<std::string>& names, int64_t min_version) {
    return Check(Stoppable([&](std::stop_token stop) { return client_->WaitVersions(names, min_version, stop); }));
  }

  double GradNorm(int64_t step) {
    return Check(Stoppable([&](std::stop_token stop) { return client_->GradNorm(step, stop); }));
  }

  // [(group, optimizer settings)]: one call per server for all of them.
  void SetHyperparams(const std::vector<std::pair<std::string, py::dict>>& groups) {
    std::vector<GroupOptimizer> settings;
    for (const auto& [name, optimizer] : groups) settings.push_back({name, ToOptimizer(optimizer)});
    Check(Stoppable([&](std::stop_token stop) { return client_->SetHyperparams(settings, stop); }));
  }

  void SaveCheckpoint(const std::string& name, const std::string& kind, bool optimizer, bool async,
                      const py::object& progress, const py::object& cut) {
    const CheckpointKind k = ToKind(kind);
    const CutAt at = ToCut(cut);
    WithProgress(progress,
                 [&](const Client::Progress& p) { return client_->SaveCheckpoint(name, k, optimizer, async, p, at); });
  }
  // (missing, unexpected): what a non-strict load left out; both empty for a strict one.
  std::pair<std::vector<std::string>, std::vector<std::string>> LoadCheckpoint(const std::string& name, bool strict,
                                                                               const py::object& progress) {
    IncompatibleTensors omitted;
    WithProgress(progress, [&](const Client::Progress& p) -> absl::Status {
      if (strict) return client_->LoadCheckpoint(name, p);
      absl::StatusOr<IncompatibleTensors> loaded = client_->LoadCheckpointNonStrict(name, p);
      if (loaded.ok()) omitted = *std::move(loaded);
      return loaded.status();
    });
    return {std::move(omitted.missing), std::move(omitted.unexpected)};
  }
  void DeleteCheckpoint(const std::string& name) {
    Check(Stoppable([&](std::stop_token stop) { return client_->DeleteCheckpoint(name, stop); }));
  }
  py::list ListCheckpoints() {
    const std::vector<CheckpointEntry> entries =
        Check(Stoppable([&](std::stop_token stop) { return client_->ListCheckpoints(stop); }));
    py::list out;
    for (const CheckpointEntry& e : entries) {
      out.append(py::dict(py::arg("name") = e.name, py::arg("complete") = e.complete,
                          py::arg("kind") = e.kind, py::arg("job") = e.job, py::arg("servers") = e.servers,
                          py::arg("optimizer") = e.optimizer, py::arg("bytes") = e.bytes,
                          py::arg("versions") = e.versions));
    }
    return out;
  }
  void ExportStateDict(const std::string& path, const std::string& kind, bool optimizer, const py::object& progress,
                       const py::object& cut) {
    const CheckpointKind k = ToKind(kind);
    const CutAt at = ToCut(cut);
    WithProgress(progress,
                 [&](const Client::Progress& p) { return client_->ExportStateDict(path, k, optimizer, p, at); });
  }

  // {"kind", "bytes", "groups", "optimizer"}: what Client::ImportCheckpoint brought in.
  py::dict ImportCheckpoint(const std::string& name, const std::string& path, bool optimizer, int64_t version,
                            const py::object& progress) {
    ImportedCheckpoint imported;
    WithProgress(progress, [&](const Client::Progress& p) -> absl::Status {
      absl::StatusOr<ImportedCheckpoint> done = client_->ImportCheckpoint(name, path, optimizer, version, p);
      if (done.ok()) imported = *std::move(done);
      return done.status();
    });
    return py::dict(py::arg("kind") = std::string(CheckpointKindName(imported.kind)), py::arg("bytes") = imported.bytes,
                    py::arg("groups") = imported.groups, py::arg("optimizer") = imported.optimizer);
  }

  void CancelCheckpointCalls() { client_->CancelCheckpointCalls(); }

  // As `flatshard status --json`; without the groups when `groups` is false.
  std::string StatusJson(bool groups) {
    const auto& options = client_->options();
    v1::GetStatusRequest request;
    request.set_omit_groups(!groups);
    request.set_summarize_groups(true);
    return ClusterStatusJson(
        options.servers,
        Stoppable([&](std::stop_token stop) { return FetchClusterStatus(options, stop, request); }), -1);
  }

  std::vector<std::string> DataPlanes() const { return client_->DataPlanes(); }

 private:
  // One Pending per future, each keeping its own buffer (keeps[k]) alive. There are as
  // many futures as groups, and as many buffers unless the call was refused for that.
  template <typename Result>
  std::vector<std::unique_ptr<Pending>> Pendings(std::vector<std::future<Result>> futures,
                                                 const std::stop_source& stop, const std::vector<py::object>& keeps) {
    std::vector<std::unique_ptr<Pending>> pendings;
    pendings.reserve(futures.size());
    for (size_t k = 0; k < futures.size(); ++k) {
      const py::object keep = k < keeps.size() ? keeps[k] : py::none();
      pendings.push_back(std::make_unique<Pending>(futures[k].share(), stop, keep, orphans_));
    }
    return pendings;
  }

  // Waits for `outcome` (a checkpoint call on a thread of its own) without the GIL,
  // looking at Python's signals every 50 ms. After a KeyboardInterrupt (Ctrl-C), or
  // another exception a signal handler raises (it stays set), calls `stop` every 50 ms
  // until the call has ended: a cancellation reaches a call in progress, and this one may
  // not have begun yet. Returns the call's result and whether it was interrupted. Called
  // with the GIL held.
  template <typename T>
  static std::pair<T, bool> AwaitInterruptibly(std::future<T>& outcome, const std::function<void()>& stop) {
    bool interrupted = false;
    py::gil_scoped_release release;
    while (outcome.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
      if (!interrupted) {
        py::gil_scoped_acquire gil;
        interrupted = PyErr_CheckSignals() != 0;
      }
      if (interrupted) stop();
    }
    return {outcome.get(), interrupted};
  }

  // Runs `call(stop_token)` (any call but a transfer or a checkpoint call: a wait for
  // other workers, or a quick call to a server that may have stopped answering) on this
  // thread without the GIL. While it waits, it looks at Python's signals every kWaitSlice
  // (flatshard::WhileWaiting); a KeyboardInterrupt (Ctrl-C), or another exception a
  // signal handler raises (it stays set), stops it and is raised once it has ended.
  template <typename F>
  std::invoke_result_t<F, std::stop_token> Stoppable(F&& call) {
    std::stop_source source;
    bool interrupted = false;
    const WhileWaiting watch([&] {
      if (interrupted) return;
      py::gil_scoped_acquire gil;
      interrupted = PyErr_CheckSignals() != 0;
      if (interrupted) source.request_stop();
    });
    std::optional<std::invoke_result_t<F, std::stop_token>> result;
    {
      py::gil_scoped_release release;
      result.emplace(call(source.get_token()));
    }
    if (interrupted) throw py::error_already_set();
    return *std::move(result);
  }

  // Runs `call` (a save, load or export) on a thread of its own, handing it `callback` (a
  // Python callable(done, total), or None) as a Client::Progress, called with the GIL
  // taken from the client's threads. A KeyboardInterrupt (Ctrl-C) meanwhile cancels the
  // call (CancelCheckpointCalls, AwaitInterruptibly) and is raised once it has ended; so
  // is an exception the callback raises, which stops further calls.
  template <typename F>
  void WithProgress(const py::object& callback, F&& call) {
    struct State {
      py::object callback;
      std::optional<py::error_already_set> error;
    };
    auto state = std::make_shared<State>(State{callback, std::nullopt});
    Client::Progress progress;
    if (!callback.is_none()) {
      progress = [state, client = client_.get()](uint64_t done, uint64_t total) {
        py::gil_scoped_acquire gil;
        if (state->error) return;
        try {
          state->callback(done, total);
        } catch (py::error_already_set& error) {
          state->error = std::move(error);
          client->CancelCheckpointCalls();
        }
      };
    }
    std::future<absl::Status> outcome = std::async(std::launch::async, [&] { return call(progress); });
    const auto [status, interrupted] = AwaitInterruptibly(outcome, [&] { client_->CancelCheckpointCalls(); });
    if (interrupted) throw py::error_already_set();
    if (state->error) throw *state->error;
    Check(status);
  }

  std::unique_ptr<Client> client_;
  std::shared_ptr<Orphans> orphans_ = std::make_shared<Orphans>();  // shared with each Pending
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  // As flatshard-server runs: without Abseil's lock-order checks (1-2% of a worker's
  // samples in steps of many small groups), unless FLATSHARD_MUTEX_DEADLOCK_DETECTION=1
  // (the Python tests set it).
  flatshard::SetLockOrderChecksFromEnvironment("FLATSHARD_MUTEX_DEADLOCK_DETECTION");
  m.doc() = "flatshard's C++ client (use the flatshard package, not this module)";
  m.attr("version") = std::string(flatshard::FlatshardVersion());
  m.attr("protocol_revision") = flatshard::kProtocolRevision;
  py::class_<Pending>(m, "Pending")
      .def("wait", &Pending::Wait, "Waits for the transfer; returns the version (gather) or 0.")
      .def("done", &Pending::Done, "True once the transfer has finished.")
      .def("cancel", &Pending::Cancel, "Stops the transfer; wait() then raises CancelledError unless it had finished.");
  py::class_<PyClient>(m, "Client")
      .def(py::init<std::vector<std::string>, int, int, std::string, double, std::string, std::string, std::string, int,
                    int64_t, int64_t, double, double, double, std::string, std::string>(),
           py::arg("servers"), py::arg("worker_rank"), py::arg("num_workers"), py::arg("token"), py::arg("timeout"),
           py::arg("job"), py::arg("device_plane"), py::arg("tls_ca_file"), py::arg("max_in_flight"),
           py::arg("gather_split_bytes"), py::arg("scatter_split_bytes"), py::arg("model_timeout"),
           py::arg("keepalive"), py::arg("tls_reload_interval"), py::arg("tls_cert_file"), py::arg("tls_key_file"))
      .def("configure_job", &PyClient::ConfigureJob)
      .def("register_groups", &PyClient::RegisterGroups)
      .def("init_groups", &PyClient::InitGroups)
      .def("init_group_from_seed", &PyClient::InitGroupFromSeed)
      .def("gather", &PyClient::Gather)
      .def("scatter", &PyClient::Scatter)
      .def("gather_many", &PyClient::GatherMany)
      .def("scatter_many", &PyClient::ScatterMany)
      .def("wait_version", &PyClient::WaitVersion)
      .def("wait_versions", &PyClient::WaitVersions)
      .def("grad_norm", &PyClient::GradNorm)
      .def("set_hyperparams", &PyClient::SetHyperparams)
      .def("save_checkpoint", &PyClient::SaveCheckpoint)
      .def("load_checkpoint", &PyClient::LoadCheckpoint)
      .def("delete_checkpoint", &PyClient::DeleteCheckpoint)
      .def("delete_job", &PyClient::DeleteJob)
      .def("list_checkpoints", &PyClient::ListCheckpoints)
      .def("export_state_dict", &PyClient::ExportStateDict)
      .def("import_checkpoint", &PyClient::ImportCheckpoint)
      .def("cancel_checkpoint_calls", &PyClient::CancelCheckpointCalls, py::call_guard<py::gil_scoped_release>())
      .def("status_json", &PyClient::StatusJson, py::arg("groups"))
      .def("data_planes", &PyClient::DataPlanes);
}

}  // namespace flatshard::python
