"""flatshard: the Python client of the flatshard parameter shard server.

    import flatshard
    with flatshard.LocalCluster(servers=2) as cluster:
        c = flatshard.Client(servers=cluster.addresses, token=cluster.token)
        c.configure_job()
        c.register_group("mlp", tensors=[("weight", (4, 3), "float32")],
                         optimizer=flatshard.AdamW(lr=1e-3))
        c.init_group("mlp", {"weight": w})
        params = c.gather("mlp")                 # {"weight": numpy array}
        c.scatter("mlp", {"weight": grad}, step=0)

Buffers cross into C++ without copies (buffer protocol for numpy arrays, DLPack for
torch tensors, CUDA tensors included); every network wait releases the GIL. Failures raise flatshard.Error subclasses carrying the status code. Arrays
are numpy arrays (CPU torch tensors are accepted wherever arrays are); bfloat16 values,
which numpy lacks, travel as their bit patterns in int16 arrays
(``torch.from_numpy(a).view(torch.bfloat16)``).
"""

import json
import os
from collections import namedtuple
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import _native
from ._errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError, DeadlineExceededError,
                      Error, FailedPreconditionError, InternalError, InvalidArgumentError,
                      NotFoundError, ResourceExhaustedError, UnauthenticatedError,
                      UnavailableError)
from .local_cluster import LocalCluster

__version__ = _native.version
# The wire protocol's revision: servers of another one refuse this client on connecting.
PROTOCOL_REVISION = _native.protocol_revision

__all__ = [
    "Client", "LocalCluster", "SGD", "Adam", "AdamW", "Frozen", "Average", "Error", "CancelledError",
    "InvalidArgumentError", "DeadlineExceededError", "NotFoundError", "AlreadyExistsError", "ResourceExhaustedError",
    "FailedPreconditionError", "AbortedError", "UnavailableError", "InternalError", "DataLossError",
    "UnauthenticatedError", "IncompatibleKeys",
]

_NUMPY = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(np.int16)}
_ALIASES = {"float": "float32", "half": "float16", "float32": "float32", "float16": "float16",
            "bfloat16": "bfloat16"}


# What Client.load_checkpoint left out (torch.nn.modules.module._IncompatibleKeys' fields).
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def dtype_name(dtype):
    """"float32" | "bfloat16" | "float16" for a name, a numpy dtype or a torch dtype."""
    text = str(dtype).replace("torch.", "")
    if text in _ALIASES:
        return _ALIASES[text]
    try:
        text = np.dtype(dtype).name
    except TypeError:
        pass
    if text in _ALIASES:
        return _ALIASES[text]
    raise InvalidArgumentError(f"dtype {dtype!r}: expected float32, bfloat16 or float16")


@dataclass
class SGD:
    """torch.optim.SGD on the servers."""
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def _spec(self):
        return dict(kind="sgd", **asdict(self))


@dataclass
class Adam:
    """torch.optim.Adam on the servers."""
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    _kind = "adam"

    def _spec(self):
        return dict(kind=self._kind, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                    eps=self.eps, weight_decay=self.weight_decay, amsgrad=self.amsgrad)


@dataclass
class AdamW(Adam):
    """torch.optim.AdamW on the servers (decoupled weight decay; torch's default 0.01)."""
    weight_decay: float = 0.01
    _kind = "adamw"


@dataclass
class Frozen:
    """No optimizer: parameters that are never trained (torch's requires_grad=False). The
    servers keep no gradient or optimizer state for the group and refuse scatters to it;
    gathers, init_group, checkpoints and export work as for any group."""

    def _spec(self):
        return dict(kind="frozen")


@dataclass
class Average:
    """Module buffers (BatchNorm's running statistics), which each worker updates in its
    forward: each step the group's values become the mean of what the workers scatter
    (whatever the job's reduce; outside clipping and the skipping of non-finite steps).
    No optimizer state; checkpoints and export hold the values. SYNC jobs only."""

    def _spec(self):
        return dict(kind="average")


def _is_torch(value):
    return hasattr(value, "detach") and hasattr(value, "data_ptr")


def _native_buffer(value, dtype, numel, what):
    """What the native client reads or writes: a numpy array as it is, or a DLPack
    capsule of a torch tensor (CPU or CUDA; a CUDA tensor uses the GPU data planes)."""
    if _is_torch(value):
        import torch.utils.dlpack
        tensor = value.detach()
        got = _ALIASES.get(str(tensor.dtype).replace("torch.", ""), str(tensor.dtype))
        if not tensor.is_contiguous() or tensor.numel() != numel or got != dtype:
            raise InvalidArgumentError(f"{what}: expected a contiguous tensor of {numel} {dtype}, "
                                       f"got {tuple(tensor.shape)} {got}")
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)  # same bits; any DLPack consumer reads int16
        if tensor.is_cuda:
            # Servers use the memory from their own streams: the work queued on this one
            # (what wrote a gradient, what still reads the parameters) must be done.
            torch.cuda.current_stream(tensor.device).synchronize()
        return torch.utils.dlpack.to_dlpack(tensor)
    array = np.asarray(value)
    if array.dtype != _NUMPY[dtype] or array.size != numel or not array.flags.c_contiguous:
        raise InvalidArgumentError(f"{what}: expected a contiguous array of {numel} {_NUMPY[dtype]}, "
                                   f"got {array.shape} {array.dtype}")
    return array


def _as_array(value):
    """A C-contiguous numpy view (or copy) of an array or torch tensor; a tensor on a GPU
    is copied to the host (per-tensor values travel as one flat host buffer)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import torch
            tensor = tensor.contiguous().view(torch.int16)
            return tensor.numpy(), "bfloat16"
        array = tensor.contiguous().numpy()
    else:
        # Not np.ascontiguousarray, which turns a 0-dim array into shape (1,).
        array = np.asarray(value)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
    try:
        return array, dtype_name(array.dtype)
    except InvalidArgumentError:
        return array, str(array.dtype)


class GroupLayout:
    """Where each tensor of a group sits in its flat parameter (FSDP layout rules)."""

    def __init__(self, info):
        self.tensors = info["tensors"]  # dicts: name, shape, dtype, offset, numel
        self.padded_numel = info["padded_numel"]
        self.unpadded_numel = info["unpadded_numel"]
        self.shard_numel = info["shard_numel"]
        self.num_shards = info["num_shards"]
        self.names = [t["name"] for t in self.tensors]
        self._known = set(self.names)

    def views(self, flat):
        """Per-tensor views (registered shapes) into a flat buffer."""
        return {t["name"]: flat[t["offset"]:t["offset"] + t["numel"]].reshape(t["shape"])
                for t in self.tensors}

    def flatten(self, values, dtype, what):
        """One padded flat buffer of `dtype` from {name: array}, checking names, shapes, dtypes."""
        missing = [n for n in self.names if n not in values]
        extra = [n for n in values if n not in self._known]
        if missing or extra:
            raise InvalidArgumentError(f"{what}: missing tensors {missing}, unknown tensors {extra}")
        flat = np.zeros(self.padded_numel, dtype=_NUMPY[dtype])
        for t in self.tensors:
            array, got = _as_array(values[t["name"]])
            if tuple(array.shape) != tuple(t["shape"]):
                raise InvalidArgumentError(f"{what}: tensor '{t['name']}' has shape {tuple(array.shape)}, "
                                           f"registered {tuple(t['shape'])}")
            if got != dtype:
                raise InvalidArgumentError(f"{what}: tensor '{t['name']}' is {got}, expected {dtype}")
            flat[t["offset"]:t["offset"] + t["numel"]] = array.reshape(-1)
        return flat


class Transfer:
    """A gather or scatter in flight; ``wait()`` returns its result (or raises its error),
    as often as it is called; ``done()`` says whether it has finished. A small transfer's
    wait() watches for it for up to 200 us before sleeping (flatshard::Await in the C++
    client), which sees it finish tens of microseconds sooner. Ctrl-C in wait() cancels
    the transfer and raises KeyboardInterrupt at once. Dropped unfinished, it does not
    wait: the client holds the buffer until the transfer ends, or cancels it when the
    client itself goes."""

    def __init__(self, pending, finish):
        self._pending = pending
        self._finish = finish

    def wait(self):
        return self._finish(self._pending.wait())

    def done(self):
        return self._pending.done()

    def cancel(self):
        """Stops the transfer: one waiting for a version stops waiting, bytes moving over
        TCP or NCCL stop at once (over CUDA IPC, once the bytes under way have moved).
        wait() then raises flatshard.CancelledError, unless it had finished; the buffer
        is the caller's again once done() is true. A cancelled gather's buffer may hold
        part of the bytes; a cancelled scatter may have reached some servers (sent again,
        it is AlreadyExistsError there)."""
        self._pending.cancel()


class Client:
    """A training worker's connection to every server of a cluster (C++ client inside).

    ``device_plane`` says how CUDA tensors reach --memory=device servers: "auto" (CUDA
    IPC on the same GPU, NCCL on another GPU or node), "cuda-ipc", "nccl" or "tcp"
    (through host memory); see ClientOptions::device_plane in the C++ client.

    ``tls_ca_file``: the PEM CA bundle of servers started with --tls_cert_file (the
    control plane then speaks TLS); None for plaintext servers. ``tls_cert_file`` and
    ``tls_key_file``: the certificate (and its key) this client presents to servers
    started with --tls_client_ca_file. They are read again every ``tls_reload_interval``
    seconds (0: once), so that reconnections trust a CA added to the bundle since (a CA
    rotation) and present a renewed certificate; files that do not parse, or a key that
    is not the certificate's, are ignored.

    ``max_in_flight``: transfers at once per server (1-64): how many gathers can be
    prefetched while others run. ``gather_split_bytes``: a gather's part from one server
    of at least this size comes in up to ``max_in_flight`` ranges at once (0: never);
    ``scatter_split_bytes`` likewise for a scatter's part to one server.

    ``timeout`` (seconds) bounds each call, transfer and wait, a checkpoint's wait for its
    cut included; ``model_timeout`` the calls whose work grows with the model as a whole
    (registering and seeding a group, saving, loading and exporting; None: no bound, as
    they take as long as the model needs). While calls are in flight each
    server is pinged every ``keepalive`` seconds (at least 1) and must answer within as
    long again, or its calls fail with flatshard.UnavailableError.

    Ctrl-C (KeyboardInterrupt) ends any call at once, also against a server that stopped
    answering, without waiting for ``timeout``: the call is cancelled (a save, load or
    export keeps nothing of itself; any other may have taken effect on some servers, as
    one that timed out, and may be made again; a server that had not received all of its
    init_group shard keeps its values); in a transfer's wait(), it cancels the transfer
    (Transfer.cancel).
    """

    def __init__(self, servers, worker_rank=0, num_workers=1, token=None, timeout=30.0,
                 job="default", device_plane="auto", tls_ca_file=None, max_in_flight=2,
                 gather_split_bytes=16 << 20, scatter_split_bytes=16 << 20,
                 model_timeout=None, keepalive=15.0, tls_reload_interval=300.0,
                 tls_cert_file=None, tls_key_file=None):
        self._native = _native.Client(list(servers), int(worker_rank), int(num_workers),
                                      token or "", float(timeout), job, device_plane,
                                      os.fspath(tls_ca_file) if tls_ca_file else "",
                                      int(max_in_flight), int(gather_split_bytes),
                                      int(scatter_split_bytes),
                                      float("inf") if model_timeout is None
                                      else float(model_timeout),
                                      float(keepalive), float(tls_reload_interval),
                                      os.fspath(tls_cert_file) if tls_cert_file else "",
                                      os.fspath(tls_key_file) if tls_key_file else "")
        self.servers = list(servers)
        self._token = token
        self._timeout = timeout
        # What a second client of these servers needs (ShardedModule's barrier).
        self._tls = dict(tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                         tls_key_file=tls_key_file, tls_reload_interval=tls_reload_interval)
        self.worker_rank = worker_rank
        self.num_workers = num_workers
        self.job = job
        self._layouts = {}
        self._optimizers = {}

    def configure_job(self, mode="sync", reduce="mean", max_grad_norm=None, norm_type=2.0,
                      max_staleness=None, replicas=1, skip_nonfinite=False):
        """Job settings, identical from every worker (idempotent).

        replicas > 1: hybrid sharding (FSDP's HYBRID_SHARD). The servers form `replicas`
        replica groups of consecutive ranks; groups are sharded inside one and replicated
        across them; worker w gathers from and scatters to replica group w % replicas.

        skip_nonfinite: a step whose reduced gradient holds inf or NaN is skipped on every
        server (parameters and optimizer state stay), as torch's GradScaler skips
        optimizer.step(); grad_norm(step) is then inf or NaN."""
        if mode not in ("sync", "async"):
            raise InvalidArgumentError(f"mode {mode!r}: expected 'sync' or 'async'")
        if reduce not in ("mean", "sum"):
            raise InvalidArgumentError(f"reduce {reduce!r}: expected 'mean' or 'sum'")
        self._native.configure_job(mode == "async", reduce == "mean", float(max_grad_norm or 0.0),
                                   float(norm_type),
                                   -1 if max_staleness is None else int(max_staleness),
                                   int(replicas), bool(skip_nonfinite))

    def delete_job(self):
        """When training is over: deletes this client's job on every server, with its
        groups, their memory and its norms; returns the bytes the servers held for it.
        Its workers' requests then raise NotFoundError (waits included), and the name may
        be configured again with any settings. NotFoundError when no server had it."""
        return self._native.delete_job()

    def register_group(self, name, tensors, optimizer, align=0):
        """Registers (or finds the identical) group: tensors = [(name, shape, dtype), ...]."""
        return self.register_groups([(name, tensors, optimizer, align)])[0]

    def register_groups(self, groups):
        """Registers several groups in one call per server (every group of a model):
        groups = [(name, tensors, optimizer) or (name, tensors, optimizer, align)], as
        register_group takes them; returns their layouts in that order. A refusal (a
        malformed spec, a name given twice, a spec that conflicts with a registered group,
        memory) names the group, and a server registers all of a call's groups or none."""
        entries, specs = [], {}
        for name, tensors, optimizer, *align in groups:
            if id(optimizer) not in specs:  # a model's groups share one optimizer object
                specs[id(optimizer)] = optimizer._spec()
            tensors = [(str(n), [int(d) for d in shape], dtype_name(dt)) for n, shape, dt in tensors]
            entries.append((name, tensors, specs[id(optimizer)], int(align[0]) if align else 0))
        layouts = [GroupLayout(d) for d in self._native.register_groups(entries)]
        for (name, _, optimizer, *_), layout in zip(groups, layouts):
            self._layouts[name] = layout
            self._optimizers[name] = optimizer
        return layouts

    def layout(self, name):
        if name not in self._layouts:
            raise NotFoundError(f"group '{name}' was not registered by this client")
        return self._layouts[name]

    def init_group(self, name, values):
        """Pushes initial values {tensor name: array} (float32); any one worker does it."""
        self.init_groups([(name, values)])

    def init_groups(self, groups):
        """Pushes several groups' initial values, groups = [(name, {tensor name: array})]
        (a dict's items() too), every push in flight at once rather than a round trip per
        group. Every group's values are checked before anything is sent; after that the
        first failure in that order is raised, naming its group (the others pushed or not
        as they would alone; pushing again is allowed before the first step). The values
        are flattened first: all of them are held twice during the call."""
        flats = [(name, self.layout(name).flatten(
            {k: _as_array(v)[0].astype(np.float32, copy=False) for k, v in values.items()},
            "float32", f"init_group('{name}')")) for name, values in groups]
        self._native.init_groups(flats)

    def init_group_from_seed(self, name, seed):
        self._native.init_group_from_seed(name, int(seed))

    def gather_async(self, name, min_version=0, dtype="float32", out=None):
        """Starts a gather into `out` (a flat numpy array or torch tensor, CPU or CUDA, of
        padded_numel elements; a new numpy array when None); wait() -> (out, version)."""
        dtype = dtype_name(dtype)
        layout = self.layout(name)
        if out is None:
            out = np.empty(layout.padded_numel, dtype=_NUMPY[dtype])
        buffer = _native_buffer(out, dtype, layout.padded_numel, f"gather('{name}') out")
        pending = self._native.gather(name, int(min_version), dtype, buffer)
        return Transfer(pending, lambda version: (out, version))

    def gather_many_async(self, names, min_version=0, dtype="float32", outs=None):
        """gather_async of several groups at once (outs[i] for names[i]; new numpy arrays
        when None): a Transfer each, in order. The requests of small groups (64 KiB or
        less per server, host memory) go to each server in pipelines of 16, so a model of
        many small layers takes a round trip per 16 of them instead of one each. The
        transfers share one stop: cancelling one (Ctrl-C in its wait) cancels them all."""
        dtype = dtype_name(dtype)
        names = list(names)
        layouts = [self.layout(name) for name in names]
        if outs is None:
            outs = [np.empty(layout.padded_numel, dtype=_NUMPY[dtype]) for layout in layouts]
        outs = list(outs)
        if len(outs) != len(names):
            raise InvalidArgumentError(f"{len(names)} groups but {len(outs)} buffers")
        buffers = [_native_buffer(out, dtype, layout.padded_numel, f"gather('{name}') out")
                   for name, layout, out in zip(names, layouts, outs)]
        pendings = self._native.gather_many(names, int(min_version), dtype, buffers)
        return [Transfer(pending, lambda version, out=out: (out, version)) for pending, out in zip(pendings, outs)]

    def gather_flat(self, name, min_version=0, dtype="float32", out=None):
        """The flat parameter (padded_numel elements) at a version >= min_version, and the version."""
        return self.gather_async(name, min_version, dtype, out).wait()

    def gather(self, name, min_version=0, dtype="float32"):
        """{tensor name: array of its registered shape} at a version >= min_version."""
        flat, _ = self.gather_flat(name, min_version, dtype)
        return self.layout(name).views(flat)

    def scatter_async(self, name, grads, step, dtype="float32"):
        """Starts a scatter of {name: gradient} (or a flat padded buffer) for `step`."""
        dtype = dtype_name(dtype)
        layout = self.layout(name)
        if isinstance(grads, dict):
            flat = layout.flatten(grads, dtype, f"scatter('{name}')")
        else:  # a flat gradient: numpy array or torch tensor (CPU or CUDA)
            flat = grads
        buffer = _native_buffer(flat, dtype, layout.padded_numel, f"scatter('{name}')")
        pending = self._native.scatter(name, int(step), dtype, buffer)
        return Transfer(pending, lambda _: None)

    def scatter_many_async(self, names, grads, step, dtype="float32"):
        """scatter_async of several groups at once (grads[i], flat buffers of padded_numel
        elements, for names[i]): a Transfer each, in order, pipelined and sharing one stop
        as gather_many_async's."""
        dtype = dtype_name(dtype)
        names, grads = list(names), list(grads)
        if len(grads) != len(names):
            raise InvalidArgumentError(f"{len(names)} groups but {len(grads)} buffers")
        buffers = [_native_buffer(grad, dtype, self.layout(name).padded_numel, f"scatter('{name}')")
                   for name, grad in zip(names, grads)]
        pendings = self._native.scatter_many(names, int(step), dtype, buffers)
        return [Transfer(pending, lambda _: None) for pending in pendings]

    def scatter(self, name, grads, step, dtype="float32"):
        """Sends this worker's gradient for `step`; returns once every server holds it.
        Sent again after a failure, it raises AlreadyExistsError when every server held
        or applied it already (the answer was lost), any other error if one still failed.
        It names the checkpoint load of this client's last gather of the group: a load
        since then (even to the same version) makes it AbortedError; gather again. A
        gather whose servers answer from two loads raises AbortedError too."""
        self.scatter_async(name, grads, step, dtype).wait()

    def version(self, name):
        """Optimizer steps applied so far (the lowest over the servers)."""
        return self._native.wait_version(name, 0)

    def wait_version(self, name, min_version):
        """Waits until every server's shard of group `name` reaches min_version; returns the
        version. Raises an ABORTED error at once when a checkpoint load sets the group below
        min_version meanwhile (the load dropped the gradients sent for the step in progress).
        Ctrl-C ends the wait at once (KeyboardInterrupt), as it does in grad_norm. When every
        server answered this client's latest scatter of the group, for step min_version - 1,
        with min_version (its gradient completed the step), it returns without asking them."""
        return self._native.wait_version(name, int(min_version))

    def wait_versions(self, names, min_version):
        """wait_version for several groups in one call per server (a step's groups: one
        round trip rather than one per group); returns their versions in `names`' order.
        A name the servers do not have raises NotFoundError before any wait."""
        return self._native.wait_versions(list(names), int(min_version))

    def grad_norm(self, step):
        """The job's total gradient norm at `step`, before clipping (what
        torch.nn.utils.clip_grad_norm_ returns); waits until the step is reduced. The job
        must clip (max_grad_norm) or skip non-finite steps (skip_nonfinite)."""
        return self._native.grad_norm(int(step))

    def set_hyperparams(self, name, **changes):
        """New hyper-parameters from the next step on, e.g. set_hyperparams("mlp", lr=5e-4)."""
        self.set_hyperparams_of([name], **changes)

    def set_hyperparams_of(self, names, **changes):
        """set_hyperparams for several groups in one call per server (a learning-rate
        schedule's change to every group, as ShardedModule.set_hyperparams makes it). Each
        server finds every group and checks its settings before it changes any."""
        # Groups registered with one optimizer object share one new object and one spec:
        # a schedule changes a model's every group each step, and a copy per group costs.
        made = {}  # id(current settings): (new settings, their spec)
        updated = {}  # group: (new settings, their spec)
        for name in names:
            current = self._optimizers.get(name)
            if current is None:
                raise NotFoundError(f"group '{name}' was not registered by this client")
            if id(current) not in made:
                unknown = [k for k in changes if not hasattr(current, k)]
                if unknown:
                    raise InvalidArgumentError(f"unknown hyper-parameters {unknown} for {type(current).__name__}")
                new = replace(current, **changes)
                made[id(current)] = (new, new._spec())
            updated[name] = made[id(current)]
        self._native.set_hyperparams([(name, spec) for name, (_, spec) in updated.items()])
        self._optimizers.update((name, new) for name, (new, _) in updated.items())

    def save_checkpoint(self, name, kind="full", optimizer=True, blocking=True, progress=None, cut=None):
        """Saves the job's groups: after the step this worker sent last when it is between
        steps (waiting for the other workers' part of that step), at their current versions
        otherwise; `progress(done, total)` (bytes, optional, blocking saves) is called a few
        times a second while the servers write.

        `cut` moves the trained groups' cut (C++ `CutAt`): "boundary" to the end of the step
        in progress (for a client that sends no gradients while workers train; the groups
        must step together), or a version, waiting for training to get there. None (or
        "now") is the default above.

        Ctrl-C (KeyboardInterrupt), an exception `progress` raises, or
        cancel_checkpoint_calls() from another thread cancels a save, load or export in
        progress: the servers stop and keep nothing of it, and the exception (or
        CancelledError) is raised once they have."""
        self._native.save_checkpoint(name, kind, bool(optimizer), not blocking, progress, cut)

    def load_checkpoint(self, name, progress=None, strict=True):
        """Loads a checkpoint into the job's registered groups (FULL and SHARDED by tensor
        name, also into groups other than the saved ones; LOCAL into the same groups);
        `progress`, and how to cancel it, as for saves. Returns
        ``IncompatibleKeys(missing_keys, unexpected_keys)``, as torch's load_state_dict.

        ``strict=False`` loads what the checkpoint and the registered groups have in common
        (fine-tuning from another model's checkpoint): a registered tensor the checkpoint
        lacks (a missing key) keeps its values and optimizer state, a checkpoint tensor no
        group registers (an unexpected key) is skipped. A group takes the saved version and
        optimizer step count of the tensors it loads (one per group: a kept tensor's Adam
        bias correction follows it); a trained group the checkpoint holds nothing of keeps
        its step count and takes the loaded trained groups' version (when they agree), so
        the job steps on together. A tensor saved with another shape or dtype is refused
        all the same, as by torch."""
        missing, unexpected = self._native.load_checkpoint(name, bool(strict), progress)
        return IncompatibleKeys(missing, unexpected)

    def list_checkpoints(self):
        return self._native.list_checkpoints()

    def delete_checkpoint(self, name):
        """Removes a checkpoint, complete or not; refused while a save of it is still
        being written (a save of a name in progress also refuses a second save)."""
        self._native.delete_checkpoint(name)

    def export_state_dict(self, path, kind="full", optimizer=False, progress=None, cut=None):
        """Streams the job's state dict into directory `path` on this machine;
        `progress(done, total)` (bytes, optional) is called as chunks arrive; `cut`, and how
        to cancel it, as for save_checkpoint."""
        self._native.export_state_dict(str(path), kind, bool(optimizer), progress, cut)

    def import_checkpoint(self, name, path, optimizer=True, version=0, progress=None):
        """The reverse of an export: streams the state dict in directory `path` on this
        machine to server 0, which checks it and commits it as checkpoint `name`;
        load_checkpoint(name) then loads it into any number of servers. FULL: what
        export_state_dict(kind="full") writes, or a model.safetensors written by torch or
        Hugging Face tools, split with its index or not (with `optimizer`, the optimizer
        files beside it); its groups are those the optimizer file's metadata describes (an
        export's, with their versions and optimizer steps), and a file without optimizer
        state is one group "imported" at `version`, whose optimizer starts afresh at a
        load. SHARDED: what export_state_dict(kind="sharded") writes (shard-<i>.safetensors),
        a SHARDED checkpoint of the exported groups (without their optimizer state unless
        `optimizer`). Returns {"kind", "bytes", "groups", "optimizer"}. `progress(done,
        total)` counts the bytes sent; cancelling, as for save_checkpoint, leaves
        nothing."""
        return self._native.import_checkpoint(str(name), str(path), bool(optimizer), int(version), progress)

    def cancel_checkpoint_calls(self):
        """Cancels this client's saves, loads, exports and imports in progress (from another
        thread): each raises CancelledError once its servers have stopped, keeping nothing
        of it (C++ `Client::CancelCheckpointCalls`)."""
        self._native.cancel_checkpoint_calls()

    def status(self, groups=True):
        """Every server's status, as `flatshard status --json`. With groups=False, each
        server's "groups" list is left out (empty): the servers answer at once however
        many groups the cluster holds (tens of thousands make megabytes of status). Each
        job's "summary" sums up its groups on that server either way (how many, their
        lowest and highest version, memory, reduce and optimizer times, a load digest)."""
        return json.loads(self._native.status_json(bool(groups)))

    def data_planes(self):
        """Per server, "tcp" or "cuda-ipc" (device buffers on this process's GPU)."""
        return self._native.data_planes()
