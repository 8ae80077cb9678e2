"""flatshard.torch: FSDP-style training of a torch.nn.Module on flatshard servers.

    model = flatshard.torch.ShardedModule(Net(), client, optimizer=flatshard.AdamW(lr=1e-3))
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()          # each group's gradient is scattered as soon as it is ready
        model.step()             # waits for the servers' new version

    model.set_hyperparams(lr=1e-4)   # a learning-rate schedule: from the next step on
    model.delete_job()               # training over (every worker done): servers free it

    # Gradient accumulation over micro-batches, as with FSDP's and DDP's no_sync():
    with model.no_sync():
        for x, y in micro_batches[:-1]:
            (loss_fn(model(x), y) / len(micro_batches)).backward()  # summed locally
    x, y = micro_batches[-1]
    (loss_fn(model(x), y) / len(micro_batches)).backward()  # adds its own, sends the sum
    model.step()

Parameters are grouped one flat parameter per wrapped submodule, chosen like FSDP's
``size_based_auto_wrap_policy``: a submodule whose not-yet-wrapped parameters number at
least ``auto_wrap_min_params`` becomes a group, the root takes the rest. Worker 0's
initial values are pushed to the servers (or, with ``load_checkpoint=NAME``, worker 0
loads that checkpoint; a group the servers have already trained is left as it is); every
worker waits for them (a barrier on the servers) before its first forward and resumes at
the servers' version. Each parameter is a view into its group's flat
buffer, which gathers fill in place (no per-tensor copies). Each forward starts the
gathers of every group (prefetch); a group's forward pre-hook waits for its own. Groups
whose parameters are used outside their module's forward (functionally, like
MultiheadAttention's out_proj, or before the module runs) are waited for up front, and so
are those whose module's forward did not run: the forwards until the first step() ends
run under a torch function mode that finds such uses and waits for the group there
(``_torch_reshard.GatherOnUse``). Gradient hooks
copy each gradient into the group's flat gradient buffer, and the group is scattered the
moment its last gradient arrives, while backward continues with the other groups; small
groups (128 KiB of gradient or less) wait in a bucket of up to 1 MiB or 64 groups, sent
together in pipelines (``Client.scatter_many_async``), as torch DDP buckets gradients.
A forward's gathers go out together likewise (``gather_many_async``).

Loss scaling for float16 (``GradScaler`` below) needs a job with ``skip_nonfinite``.

By default a worker holds every group's full parameters (gathered again in place each
step) and their gradients, as FSDP's NO_SHARD holds them. ``reshard_after_forward=True``
is FSDP's FULL_SHARD: a group's parameters are freed once its module's forward has run
and gathered again (at the step's version) when backward reaches the module. Each
group's turn, in forward or backward, prefetches the groups that come after it in the
order the last forward ran them (in backward, the reverse of the order their forwards
ended): the next one, and more while their parameters fit in 1 MiB, so that small groups
go in pipelines. A parameter's gradient goes into its group's flat gradient buffer alone
(``param.grad`` stays None), which is freed once sent. So a worker holds the parameters of
the group in use and those prefetched, and the gradients in flight, besides the root
group (the leftover parameters: backward begins with them) and the groups of shared
parameters (tied embeddings: another module uses them). Frozen parameters are wrapped
by module too, ``<module's group>.<frozen>`` (the frozen base layers of a model trained
through adapters, as in LoRA, are most of it): gathered and freed alike, and in backward
freed once backward has gone through their module (no gradient of theirs says so: an
identity autograd function on the module's inputs does); the frozen parameters of no
wrapped module stay in ``<name>.<frozen>``, held.
The memory goes with the storage of the flat buffer (as FSDP frees it), so autograd's
saved views see the parameters gathered again; a freed parameter is an empty tensor, so
that a use of it outside its module's forward fails on its shape. Wrapping frees them;
the first step's forwards (and any before it) prefetch in the order the modules were
registered, and the torch function mode above gathers the parameters of a group used
outside its module's forward (as MultiheadAttention's out_proj, or a weight used again
after its module): those groups, and those whose module's forward did not run, are
gathered up front and held through later steps. A recomputation in backward
(activation checkpointing) gathers what it needs and keeps it until its gradients are
in. It costs a second gather of every freed group per backward.

A checkpoint load while the workers train (an operator rolling the job back or forward)
voids the step in progress: ``step()`` or the next forward raises ``AbortedError``, and
the module resumes at the loaded version, so the loop goes on with its next batch.

``param_dtype`` / ``reduce_dtype`` follow FSDP's ``MixedPrecision``: parameters are
gathered in param_dtype (the servers keep the fp32 master and cast), gradients are sent
in reduce_dtype (default: param_dtype) and accumulated in it under ``no_sync()``. One
backward per step outside ``no_sync()`` (a second one raises); sync jobs only. Modules
of the classes in ``full_precision_modules`` (default BatchNorm's, as FSDP's
``MixedPrecision`` leaves them out) stay in fp32 under a lower param_dtype or
reduce_dtype: their parameters are a flat parameter of their own,
``<module's group>.<full_precision>``, gathered and sent in fp32; their floating buffers
are fp32; their forward takes its floating inputs cast to fp32 and gives its outputs back
in the inputs' dtype, as FSDP's hooks do.

Shared parameters (tied embeddings: one Parameter under several names) are stored once,
under the first name ``named_parameters()`` gives; ``state_dict()`` repeats them under
every name, as torch's does, and so the buffers of a module registered under two paths. Frozen parameters (``requires_grad=False`` when the module
is wrapped) live in one group of their own, named ``<name>.<frozen>``: on the servers, so
checkpoints hold them and every worker gets worker 0's values, but gathered once, never
sent gradients and never stepped (torch's optimizers skip a parameter without a gradient,
weight decay included).

Module buffers in the state dict (BatchNorm's running statistics, num_batches_tracked)
live on the servers too, in a group ``<name>.<buffers>`` (``flatshard.Average()``): each
worker's forwards update its own copy, step() sends it, the servers keep the workers'
mean, and the next forward gathers it back. Every worker thus starts a step from the
same buffers (DDP broadcasts rank 0's instead), one worker's are torch's, and
state_dict(), checkpoints and exports hold them at the parameters' version. They are
held in fp32 (integers exact to 2**24); buffers registered with ``persistent=False`` stay
on each worker, as torch's state_dict leaves them out.

Optimizer settings per parameter, as torch optimizers take param groups (no weight
decay on biases and norms, a head at its own learning rate)::

    no_decay = [p for p in net.parameters() if p.ndim < 2]
    model = ShardedModule(net, client, optimizer=flatshard.AdamW(lr=1e-3, weight_decay=0.1),
                          param_groups=[{"params": no_decay, "weight_decay": 0.0}])
    model.set_hyperparams(lr=5e-4)                 # every parameter's learning rate
    model.set_hyperparams(lr=1e-4, param_group=0)  # param_groups[0]'s alone

Each entry lists parameters of the module (or their names) with the hyper-parameters in
which they differ from ``optimizer``; the others keep ``optimizer``'s. A flat parameter
has one optimizer setting (as FSDP's), so a wrapped module whose parameters are in
several entries gets a flat parameter per entry: ``<module's group>.<param_groups[k]>``
for entry k, beside the module's own group for those in none. FULL and SHARDED
checkpoints load by tensor name, into a module wrapped with other entries (or another
``auto_wrap_min_params``) too; LOCAL ones only into the same groups.
``load_strict=False`` loads another model's checkpoint for fine-tuning, as torch's
``load_state_dict(strict=False)``: worker 0 pushes its values, then loads what the
checkpoint holds of the module's parameters (``load_result`` says what it left out)::

    net.head = nn.Linear(768, 3)  # a new head, not in the pretrained checkpoint
    model = ShardedModule(net, client, optimizer, load_checkpoint="pretrained", load_strict=False)
    model.load_result  # IncompatibleKeys(missing_keys=['head.weight', ...], unexpected_keys=[...])

torch's learning-rate schedulers drive the servers' optimizer through ``ServerOptimizer``
(below), a torch.optim.Optimizer whose param_groups stand for the module's.
"""

import collections
import contextlib
import dataclasses
import itertools
import math
import os
import tempfile
import uuid

import numpy as np
import torch

import flatshard
from flatshard import _safetensors, _torch_reshard
from flatshard._torch_flat import Buffers, Group, client_buffer

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_PUSH_BYTES = 64 << 20  # initial values pushed per init_groups call (ShardedModule._push)
# Gradients of small groups wait in a bucket, sent together (scatter_many_async: in
# pipelines) once it holds this many bytes or groups, or at step(); a larger group goes
# at once, as torch DDP's gradient buckets do.
_BUCKET_GROUP_BYTES = 128 << 10
_BUCKET_BYTES = 1 << 20
_BUCKET_GROUPS = 64


def _auto_wrap(module, min_params, keep, prefix=""):
    """FSDP-style size-based grouping of the parameters for which keep(fqn, param) holds:
    returns (groups, leftover params).

    groups: [(module path, [(fqn, param)])] in pre-order of the wrapped modules.
    """
    groups, leftover = [], []
    for child_name, child in module.named_children():
        child_prefix = f"{prefix}{child_name}."
        child_groups, child_left = _auto_wrap(child, min_params, keep, child_prefix)
        groups.extend(child_groups)
        if sum(p.numel() for _, p in child_left) >= min_params:
            groups.append((child_prefix[:-1], child_left))
        else:
            leftover.extend(child_left)
    own = [(f"{prefix}{n}", p) for n, p in module.named_parameters(recurse=False)]
    return groups, [(fqn, p) for fqn, p in own if keep(fqn, p)] + leftover


def _cast_floats(value, dtype):
    """`value` with every floating tensor in it (nested in tuples, lists and dicts) cast to
    `dtype`."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _floating_dtype(value):
    """The dtype of the last floating tensor in `value` (as _cast_floats walks it), or None."""
    if torch.is_tensor(value):
        return value.dtype if value.is_floating_point() else None
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    found = None
    for v in values:
        found = _floating_dtype(v) or found
    return found


def _full_precision_modules(module, classes):
    """The submodules of `module` that are instances of `classes` (ShardedModule's
    full_precision_modules), outermost only: one inside another is in full precision
    already."""
    classes = tuple(classes or ())
    if not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise flatshard.InvalidArgumentError(
            f"full_precision_modules: expected torch.nn.Module classes, got {list(classes)}")
    found, inside = [], set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, classes):
            continue
        found.append(m)
        inside.update(id(s) for s in m.modules())
    return found


def _run_in_full_precision(module):
    """Hooks that run `module`'s forward in fp32, as FSDP's do for the module classes its
    MixedPrecision leaves out: floating inputs cast to fp32, floating outputs cast back to
    the dtype of the last floating input (when it was another)."""
    cast_from = []  # the dtype of each forward in progress (a stack: a module may call itself)

    def before(_module, args):
        dtype = _floating_dtype(args)
        cast_from.append(dtype if dtype not in (None, torch.float32) else None)
        return _cast_floats(args, torch.float32) if cast_from[-1] is not None else None

    def after(_module, _args, output):
        dtype = cast_from.pop()
        return _cast_floats(output, dtype) if dtype is not None else None

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _precision_suffix(full_precision):
    """What a flat parameter's name ends with: `.<full_precision>` for the one of a
    module's parameters that stay fp32 under a lower param_dtype."""
    return ".<full_precision>" if full_precision else ""


def _parameter_names(module):
    """(canonical, aliases): canonical maps id(param) to the name named_parameters() gives
    it (its first); aliases maps every other name of a shared parameter to that one."""
    canonical = {id(p): fqn for fqn, p in module.named_parameters()}
    aliases = {}
    for path, submodule in module.named_modules(remove_duplicate=False):
        for n, p in submodule.named_parameters(recurse=False):
            fqn = f"{path}.{n}" if path else n
            if fqn != canonical[id(p)]:
                aliases[fqn] = canonical[id(p)]
    return canonical, aliases


def _param_group_settings(optimizer, param_groups, canonical, aliases):
    """torch-style param_groups for ShardedModule: returns (optimizers, entry_of), where
    optimizers[k] is `optimizer` with param_groups[k]'s hyper-parameters and entry_of maps
    the canonical name of each parameter listed to its entry k (the others keep
    `optimizer`). Raises InvalidArgumentError for an entry that is not a dict with
    "params", a hyper-parameter `optimizer` does not have, a tensor that is not one of
    the module's parameters, an unknown name, or a parameter in two entries."""
    optimizers, entry_of = [], {}
    names = set(canonical.values())
    known = {field.name for field in dataclasses.fields(optimizer)} if dataclasses.is_dataclass(optimizer) else set()
    for k, entry in enumerate(param_groups or []):
        where = f"param_groups[{k}]"
        if not isinstance(entry, dict) or "params" not in entry:
            raise flatshard.InvalidArgumentError(f"{where}: expected a dict with 'params' (and hyper-parameters)")
        overrides = {key: value for key, value in entry.items() if key != "params"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise flatshard.InvalidArgumentError(
                f"{where}: unknown hyper-parameters {unknown} for {type(optimizer).__name__}")
        optimizers.append(dataclasses.replace(optimizer, **overrides))
        params = entry["params"]
        for param in [params] if isinstance(params, (str, torch.Tensor)) else params:
            if isinstance(param, str):
                fqn = aliases.get(param, param)
                if fqn not in names:
                    raise flatshard.InvalidArgumentError(f"{where}: '{param}' is not a parameter of the module")
            else:
                fqn = canonical.get(id(param))
                if fqn is None:
                    raise flatshard.InvalidArgumentError(
                        f"{where}: a tensor of shape {tuple(getattr(param, 'shape', ()))} that is not one of "
                        "the module's parameters")
            if entry_of.setdefault(fqn, k) != k:
                raise flatshard.InvalidArgumentError(
                    f"parameter '{fqn}' is in param_groups[{entry_of[fqn]}] and {where}")
    return optimizers, entry_of


def _persistent_buffers(module):
    """[(fqn, owning module, attribute)] of what module.state_dict() holds besides
    parameters (torch leaves out buffers registered with persistent=False)."""
    entries = []
    for path, submodule in module.named_modules():
        for attr, buffer in submodule._buffers.items():
            if buffer is None or attr in submodule._non_persistent_buffers_set:
                continue
            fqn = f"{path}.{attr}" if path else attr
            if buffer.is_complex():
                raise flatshard.InvalidArgumentError(
                    f"buffer '{fqn}' is {buffer.dtype}: the servers hold buffers as float32 (register it with "
                    "persistent=False to keep it on each worker)")
            entries.append((fqn, submodule, attr))
    return entries


def _by_dtype(groups, dtype_of):
    """{dtype name: [group]} in the groups' order, for a transfer call per dtype."""
    calls = {}
    for group in groups:
        calls.setdefault(_NAMES[dtype_of(group)], []).append(group)
    return calls


def _buffer_aliases(module):
    """{alias: name}: every persistent buffer of a submodule reachable under several paths
    (one module registered twice) under each path after its first, which
    _persistent_buffers names it by, as torch's state_dict lists it under every path."""
    first, aliases = {}, {}
    for path, submodule in module.named_modules(remove_duplicate=False):
        canonical = first.setdefault(id(submodule), path)
        if canonical == path:
            continue
        for attr, buffer in submodule._buffers.items():
            if buffer is not None and attr not in submodule._non_persistent_buffers_set:
                aliases[f"{path}.{attr}"] = f"{canonical}.{attr}"  # never the root: it is in no module
    return aliases


class _Bucket:
    """Small groups whose gradients wait to be sent together (ShardedModule._scatter). A
    plain object: each change of a module's attribute costs a torch.nn.Module.__setattr__,
    and a bucket changes for every group every step."""

    def __init__(self):
        self.groups = []
        self.bytes = 0

    def add(self, group, size):
        """Adds `group` with its `size` bytes of gradient; True once the bucket is full."""
        self.groups.append(group)
        self.bytes += size
        return self.bytes >= _BUCKET_BYTES or len(self.groups) >= _BUCKET_GROUPS

    def clear(self):
        self.groups, self.bytes = [], 0


_STATES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")  # as the servers name them


def _replace_optimizer_state(group, given, arrays, metadata):
    """Puts the state `given` ({fqn: torch optimizer state}) of `group`'s parameters into
    an export's optimizer `arrays` and `metadata` (ShardedModule.load_optim_state_dict)."""
    states = [s for s in _STATES if f"{group.params[0][0]}.{s}" in arrays]  # what the group keeps
    saved = {fqn: {k: v for k, v in (given.get(fqn) or {}).items() if v is not None} for fqn, _ in group.params}
    held = [fqn for fqn, _ in group.params if saved[fqn]]
    if held and len(held) != len(group.params):
        lacking = next(fqn for fqn, _ in group.params if not saved[fqn])
        raise flatshard.InvalidArgumentError(
            f"'{held[0]}' has optimizer state and '{lacking}' has none, but they share flat parameter "
            f"'{group.name}' and its step count: give both, or neither (to start it afresh)")
    steps = set()
    for fqn, param in group.params:
        values = dict(saved[fqn])
        if "step" in values:
            steps.add(int(float(values.pop("step"))))
        extra = sorted(set(values) - set(states))
        if extra:
            raise flatshard.InvalidArgumentError(
                f"optimizer state {extra} of '{fqn}': flat parameter '{group.name}' "
                f"({metadata[group.name + '.optimizer']}) keeps {states}")
        for state in states:
            if held and state not in values:
                raise flatshard.InvalidArgumentError(f"'{fqn}' lacks optimizer state '{state}'")
            value = (torch.as_tensor(values[state]).detach().float().cpu().numpy() if held
                     else np.zeros(tuple(param.shape), np.float32))
            if value.shape != tuple(param.shape):
                raise flatshard.InvalidArgumentError(
                    f"optimizer state '{state}' of '{fqn}' has shape {list(value.shape)}, "
                    f"the parameter {list(param.shape)}")
            arrays[f"{fqn}.{state}"] = value
    if metadata[group.name + ".optimizer"] in ("adam", "adamw"):
        if held and len(steps) != 1:
            raise flatshard.InvalidArgumentError(
                f"the parameters of flat parameter '{group.name}' share one Adam step count; "
                f"the state gives {sorted(steps) or 'none'}")
        metadata[group.name + ".step"] = str(steps.pop() if held else 0)
    else:  # SGD keeps no step in torch's state: momentum buffers say whether momentum has begun
        metadata[group.name + ".momentum_initialized"] = "true" if held and "momentum_buffer" in states else "false"


class ShardedModule(torch.nn.Module):
    """Wraps `module` so its parameters live on the flatshard servers (see module doc);
    reshard_after_forward=True frees each wrapped module's full parameters between its
    forward and its backward (FSDP's FULL_SHARD)."""

    def __init__(self, module, client, optimizer, param_dtype=None, reduce_dtype=None,
                 auto_wrap_min_params=100_000, name="model", load_checkpoint=None, param_groups=None,
                 load_strict=True, full_precision_modules=(torch.nn.modules.batchnorm._BatchNorm,),
                 reshard_after_forward=False):
        super().__init__()
        if getattr(module, "_flatshard_wrapped", False):  # its parameters' hooks send to that one
            raise flatshard.InvalidArgumentError(
                f"this {type(module).__name__} is wrapped by a ShardedModule already, whose gradient hooks "
                "its parameters keep: wrap a new instance of the model")
        self.module = module
        self._client = client
        self._step = 0
        self._accumulating = False  # inside no_sync()
        self._grad_scale = 1.0  # GradScaler.scale(): gradients are divided by it before sending
        self._voided = False  # a load voided the step: step() waits for the next forward
        if not isinstance(reshard_after_forward, bool):
            raise flatshard.InvalidArgumentError(
                f"reshard_after_forward: expected True or False, got {reshard_after_forward!r}")
        # reshard_after_forward: the order in which this forward's resharding groups began
        # and ended their forwards, and from the last forward's, which to prefetch after which.
        self._forward_calls, self._finished_calls = [], []
        self._forward_prefetch = self._backward_prefetch = None  # _torch_reshard.Prefetch
        self._in_backward = False  # between a backward's first pre-backward hook and its end
        self._scattering = []  # resharding groups whose gradient is in flight (freed once sent)
        self._name = name
        self._bucket = _Bucket()
        self._param_dtype = param_dtype or torch.float32
        self._reduce_dtype = reduce_dtype or self._param_dtype
        for dtype in (self._param_dtype, self._reduce_dtype):
            if dtype not in _NAMES:
                raise flatshard.InvalidArgumentError(f"dtype {dtype}: expected float32, bfloat16 or float16")
        # FSDP's MixedPrecision._module_classes_to_ignore: modules kept in fp32 (nothing to
        # keep apart when everything is fp32).
        full_precision = _full_precision_modules(module, full_precision_modules)
        if self._param_dtype == torch.float32 and self._reduce_dtype == torch.float32:
            full_precision = []
        in_full_precision = {id(p) for m in full_precision for p in m.parameters()}
        with torch.no_grad():  # their buffers are fp32 before the servers' group of buffers is laid out
            for m in full_precision:
                for submodule in m.modules():
                    for attr, buffer in submodule._buffers.items():
                        if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                            submodule._buffers[attr] = buffer.float()
        canonical, self._aliases = _parameter_names(module)  # parameters' aliases, then buffers'
        optimizers, entry_of = _param_group_settings(optimizer, param_groups, canonical, self._aliases)
        self._param_group_count = len(optimizers)
        self._entry_settings = [optimizer] + optimizers  # what ServerOptimizer starts from
        self._hyperparams_from = None  # a ServerOptimizer whose changes forward sends
        wrapped, rest = _auto_wrap(
            module, auto_wrap_min_params,
            lambda fqn, p: p.requires_grad and canonical[id(p)] == fqn)
        if rest:
            wrapped.insert(0, ("", rest))  # the root group: forward starts there
        # FSDP's FULL_SHARD frees a unit's parameters after its forward, but not the root's
        # (backward begins with it); nor does it free a shared parameter's, which another
        # module's forward uses.
        shared = set(self._aliases.values())
        # Resharded, frozen parameters are wrapped by module too (a frozen model under
        # adapters, as in LoRA fine-tuning, is most of it), each module's a flat parameter
        # of its own beside its trained one; the rest stay in the frozen group, held.
        frozen_wrapped = []
        if reshard_after_forward:
            frozen_wrapped, _ = _auto_wrap(
                module, auto_wrap_min_params,
                lambda fqn, p: not p.requires_grad and canonical[id(p)] == fqn and fqn not in shared)
        in_wrapped = {id(p) for _, params in frozen_wrapped for _, p in params}
        frozen = [(fqn, p) for fqn, p in module.named_parameters() if not p.requires_grad and id(p) not in in_wrapped]
        frozen_full = [(fqn, p) for fqn, p in frozen if id(p) in in_full_precision]
        frozen = [(fqn, p) for fqn, p in frozen if id(p) not in in_full_precision]
        buffers = _persistent_buffers(module)
        self._aliases.update(_buffer_aliases(module))
        modules = dict(module.named_modules())
        # fp32 initial values, taken before the parameters become views of (possibly
        # bf16) flat buffers: the servers' master copy starts from full precision.
        initial = {fqn: p.detach().float().clone() for fqn, p in module.named_parameters()}
        initial.update({fqn: getattr(owner, attr).detach().float().clone() for fqn, owner, attr in buffers})
        # Every group in one call per server: (name, module path, parameters, optimizer,
        # param_groups entry, in full precision). A wrapped module whose parameters are in
        # several entries gets a flat parameter per entry, as FSDP needs one optimizer
        # setting per flat parameter: the parameters in none of them first, under the
        # module's own name; and one more for each entry's parameters kept in fp32, as a
        # flat parameter has one dtype.
        specs = []
        for path, params in wrapped:
            base = f"{name}.{path or '<root>'}"
            by_entry = collections.defaultdict(list)
            for fqn, param in params:
                by_entry[entry_of.get(fqn, -1), id(param) in in_full_precision].append((fqn, param))
            for entry, full in sorted(by_entry):
                group_name = (base if entry < 0 else f"{base}.<param_groups[{entry}]>") + _precision_suffix(full)
                specs.append((group_name, path, by_entry[entry, full], optimizer if entry < 0 else optimizers[entry],
                              None if entry < 0 else entry, full))
        trained = len(specs)
        for path, params in frozen_wrapped:
            for full in (False, True):
                members = [(fqn, p) for fqn, p in params if (id(p) in in_full_precision) == full]
                if members:
                    specs.append((f"{name}.{path}.<frozen>{_precision_suffix(full)}", path, members,
                                  flatshard.Frozen(), None, full))
        wrapped_frozen = len(specs)
        for params, full in ((frozen, False), (frozen_full, True)):
            if params:
                specs.append((f"{name}.<frozen>{_precision_suffix(full)}", None, params, flatshard.Frozen(), None,
                              full))
        registered = [(group_name, [(fqn, tuple(p.shape), "float32") for fqn, p in params], group_optimizer)
                      for group_name, _, params, group_optimizer, _, _ in specs]
        if buffers:
            registered.append((f"{name}.<buffers>", [(fqn, tuple(getattr(owner, attr).shape), "float32")
                                                     for fqn, owner, attr in buffers], flatshard.Average()))
        layouts = client.register_groups(registered) if registered else []
        groups = [Group(group_name, path, modules[path] if path is not None else None, params, layout,
                         torch.float32 if full else self._param_dtype, torch.float32 if full else self._reduce_dtype,
                         trained=k < trained, param_group=entry,
                         reshards=reshard_after_forward and bool(path) and not any(fqn in shared for fqn, _ in params))
                  for k, ((group_name, path, params, _, entry, full), layout) in enumerate(zip(specs, layouts))]
        self._groups = groups[:trained]  # trained, in forward order
        self._frozen_wrapped = groups[trained:wrapped_frozen]  # resharded frozen parameters, by module
        self._frozen = groups[wrapped_frozen:len(specs)]  # the other frozen parameters (a group per dtype)
        self._used = self._groups + self._frozen_wrapped  # the groups forwards gather, by index
        self._group_bytes = [group.flat.numel() * group.flat.element_size() for group in self._used]
        # Until a step has been watched (GatherOnUse), the groups' parameters, and the order
        # in which the resharding groups' modules were registered: the guess at their
        # forwards' order.
        self._owners = {id(param): index for index, group in enumerate(self._used) for _, param in group.params}
        self._watching = bool(self._owners)
        registered_at = {path: k for k, path in enumerate(modules)}
        self._module_order = sorted((index for index, group in enumerate(self._used) if group.reshards),
                                    key=lambda index: registered_at[self._used[index].path])
        self._buffer_group = Buffers(f"{name}.<buffers>", buffers, layouts[-1]) if buffers else None
        # Worker 0's load_checkpoint: what it left out (None elsewhere, or without one).
        self.load_result = None
        self._initialize(name, load_checkpoint, load_strict, initial)
        del initial
        for index, group in enumerate(self._used):
            group.module.register_forward_pre_hook(
                lambda _m, inputs, index=index: self._before_forward(index, inputs))
            if group.reshards:
                group.module.register_forward_hook(
                    lambda _m, _inputs, output, index=index: self._after_forward(index, output))
            for fqn, param in group.params if group.trained else ():
                param.register_hook(lambda grad, group=group, fqn=fqn: self._on_grad(group, fqn, grad))
                if group.reshards:  # runs once the parameter's gradient is accumulated
                    accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
                    accumulator.register_hook(
                        lambda *_, group=group, fqn=fqn, param=param: self._after_accumulate(group, fqn, param))
                    group.accumulators.append(accumulator)
            # The servers hold them now: gathered as their forwards come. (Freed after their
            # gradient accumulators are made: those take the parameters' shapes.)
            if group.reshards:
                group.release()
                if group.trained:
                    group.release_grad()
        for m in full_precision:
            _run_in_full_precision(m)
        self._params = list(self.parameters())  # what _clear_grads clears each step
        module._flatshard_wrapped = True

    @property
    def groups(self):
        """[(group name, module path, [parameter fqn])], in forward order, then (with
        reshard_after_forward) the frozen parameters' groups by module,
        `<module's group>.<frozen>`, then the other frozen parameters' groups (module path
        None; a second, `<frozen>.<full_precision>`, for those of full_precision_modules
        under a lower param_dtype)."""
        return [(g.name, g.path, [f for f, _ in g.params]) for g in self._all_groups()]

    def _all_groups(self):
        return self._used + self._frozen

    def _pushed_groups(self):
        """Every group worker 0 pushes: the flat parameters, then the buffers'."""
        return self._all_groups() + ([self._buffer_group] if self._buffer_group else [])

    def _stepped(self):
        """The groups a step sends to and waits for: the trained ones, then the buffers'."""
        return self._groups + ([self._buffer_group] if self._buffer_group else [])

    @property
    def version(self):
        return self._step

    def _initialize(self, name, checkpoint, strict, initial):
        """Worker 0 pushes its values (or loads `checkpoint` into the servers; a
        non-strict load over the values it pushed); a one-element barrier job makes the
        others wait; training resumes at the servers' version."""
        c = self._client
        names = [group.name for group in self._stepped() or self._all_groups()]
        if c.worker_rank == 0:
            fresh = not names or not any(c.wait_versions(names, 0))
            if fresh and not (checkpoint and strict):
                self._push(self._pushed_groups(), lambda group: {fqn: initial[fqn] for fqn, _ in group.params})
            if checkpoint:
                self.load_result = c.load_checkpoint(checkpoint, strict=strict)
        barrier = self._barrier_client()
        barrier.configure_job()
        barrier.register_group("barrier", [("x", (1,), "float32")], flatshard.SGD(lr=0.0))
        start = barrier.version("barrier")
        barrier.scatter("barrier", {"x": np.zeros(1, np.float32)}, step=start)
        barrier.wait_version("barrier", start + 1)
        self._step = self._servers_version()
        self._gather_frozen()

    def _push(self, groups, values_of):
        """Pushes values_of(group) ({fqn: tensor}) of every group: in init_groups calls of
        about _PUSH_BYTES of values each, so that a model of many groups takes a few calls
        while a large one is never flattened whole at once."""
        batch, held = [], 0
        for group in groups:
            batch.append((group.name, values_of(group)))
            held += 4 * group.layout.padded_numel
            if held >= _PUSH_BYTES:
                self._client.init_groups(batch)
                batch, held = [], 0
        if batch:
            self._client.init_groups(batch)

    def _barrier_client(self):
        """A client of the one-element job that _initialize's barrier uses."""
        c = self._client
        return flatshard.Client(c.servers, c.worker_rank, c.num_workers, token=c._token,
                                timeout=c._timeout, job=f"{c.job}.{self._name}.barrier",
                                max_in_flight=1, **c._tls)

    def delete_job(self):
        """When training is over (every worker done with the module): deletes the job on
        the servers with its groups, and the job of the start-up barrier
        (Client.delete_job). Returns the bytes the servers held for them. The module is of
        no further use."""
        freed = self._client.delete_job()
        try:
            freed += self._barrier_client().delete_job()
        except flatshard.NotFoundError:  # another worker deleted it already
            pass
        return freed

    def _gather_frozen(self):
        """Fills the frozen parameters from the servers (they never change there): every
        group's gather settles (none writes into its buffer later) before an error is raised."""
        transfers = [self._client.gather_async(group.name, 0, _NAMES[group.param_dtype], out=group.flat_buffer)
                     for group in self._frozen]
        errors = []
        for transfer in transfers:
            try:
                transfer.wait()
            except Exception as e:  # noqa: BLE001 (raised below)
                errors.append(e)
        if errors:
            raise errors[0]

    def _gather_all(self):
        # Every group is at self._step when a forward starts (step() waited for it), so a
        # gather asks for no version: one that comes at another means that a checkpoint
        # load moved the servers, which _wait_gather reports (rather than wait for a
        # version that a load back would never bring).
        # Resharding groups are gathered as their forwards come (each prefetching those
        # after it in the last forward's order, or in the modules' before any), but for those
        # prefetched from the start and those used outside their module's forward or whose
        # module's forward was not seen to run in the watched step.
        if self._forward_calls:
            self._forward_prefetch = _torch_reshard.Prefetch(self._forward_calls, self._group_bytes)
        elif self._forward_prefetch is not None:
            self._forward_prefetch.issued = -1  # the same order again
        elif self._module_order:  # no forward seen yet
            self._forward_prefetch = _torch_reshard.Prefetch(self._module_order, self._group_bytes)
        first = set(self._forward_prefetch.ahead(None)) if self._forward_prefetch else set()
        self._forward_calls, self._finished_calls = [], []
        gather = [group for index, group in enumerate(self._used)
                  if self._needs_gather(group) and (not group.reshards or group.eager or index in first)]
        # The buffers (fp32) once per step: later forwards of the step go on from the
        # buffers as those left them, as torch's do.
        buffers = self._buffer_group
        if buffers is not None and buffers.gathered_step != self._step:
            gather.append(buffers)
        self._issue_gathers(gather)
        if buffers is not None and buffers.pending_gather is not None:
            self._wait_gather(buffers)  # on failure the next forward gathers again
            buffers.unpack()  # the servers' values of this step: the workers' mean of the last
        for group in self._used:
            if group.eager:
                self._wait_gather(group)

    def _needs_gather(self, group):
        """Whether `group` holds neither this step's parameters nor a gather of them."""
        return group.pending_gather is None and (group.gathered_step != self._step or not group.resident)

    def _issue_gathers(self, groups):
        """Starts the gathers of `groups` (restored first where freed): one call per dtype
        (a flat parameter in full precision beside lower ones), in pipelines where the
        groups are small."""
        for group in groups:
            if not group.resident:
                group.restore()
        for dtype, members in _by_dtype(groups, lambda group: group.param_dtype).items():
            transfers = self._client.gather_many_async([group.name for group in members], 0, dtype,
                                                       [group.flat_buffer for group in members])
            for group, transfer in zip(members, transfers):
                group.gathered_step = self._step  # later forwards of the step reuse it
                group.pending_gather = transfer

    def _wait_gather(self, group):
        if group.pending_gather is not None:
            pending, group.pending_gather = group.pending_gather, None
            try:
                _, version = pending.wait()
            except BaseException:
                group.gathered_step = None  # the next forward gathers again
                raise
            # A frozen group's version stays where it was whatever the step: a trained group's
            # says that a load moved the servers.
            moved = version != group.gathered_step and group.trained
            if group.gathered_step is not None and moved:
                step, group.gathered_step = group.gathered_step, None
                raise self._moved(version, step)

    @staticmethod
    def _moved(version, step):
        return flatshard.AbortedError(
            f"the servers are at version {version} during step {step}: a checkpoint load moved "
            "them; the step is void and the module resumes at their version")

    def _before_forward(self, index, inputs):
        """A group's module begins its forward: its parameters are there when this returns.
        A resharding frozen group's inputs that require grad are returned through
        AfterBackward (_torch_reshard), whose backward frees the group once backward has gone through the
        module (no gradient of its own says so)."""
        group = self._used[index]
        group.fired = True
        if group.reshards:
            self._forward_calls.append(index)
            self._gather_ahead(group, self._forward_prefetch, index)
        self._wait_gather(group)
        if group.reshards and not group.trained and torch.is_grad_enabled():
            needing = [k for k, value in enumerate(inputs) if torch.is_tensor(value) and value.requires_grad]
            if needing:
                passed = _torch_reshard.AfterBackward.apply(lambda: self._release_unless_functional(group),
                                                            *[inputs[k] for k in needing])
                inputs = list(inputs)
                for k, value in zip(needing, passed):
                    inputs[k] = value
                return tuple(inputs)
        return None

    def _gather_ahead(self, group, prefetch, index):
        """Starts `group`'s gather where it needs one, then those `prefetch` (a Prefetch or
        None) says to start at its turn (`index`), in one call."""
        if self._needs_gather(group):
            self._issue_gathers([group])
        if prefetch is not None:
            self._issue_gathers([self._used[i] for i in dict.fromkeys(prefetch.ahead(index))
                                 if self._needs_gather(self._used[i])])

    def _gather_for_use(self, index):
        """A watched forward uses a group's parameters (GatherOnUse): unless its module's
        forward has them ready, they are used outside it, and are gathered (or their gather
        waited for) now; from the next step on, up front (and a resharding group's are held
        through the step)."""
        group = self._used[index]
        needs_gather = self._needs_gather(group)
        if group.pending_gather is None and not needs_gather:
            return
        group.functional = True
        if needs_gather:
            self._issue_gathers([group])
        self._wait_gather(group)

    def _release_unless_functional(self, group):
        """Frees a resharding group's parameters after its module's forward or backward,
        unless they are used outside it (freed once their gradients are in, or at the end
        of backward)."""
        if not group.functional:
            self._release(group)

    def _release(self, group):
        """Frees a resharding group's parameters, once a gather in flight into them settled
        (its error is dropped: the group is gathered again when next used)."""
        try:
            self._wait_gather(group)
        except Exception:  # noqa: BLE001 (not resident: its next use gathers and reports)
            pass
        if group.resident:
            group.release()

    def _after_forward(self, index, output):
        """A resharding group's module ran its forward: its parameters are freed, and hooks
        on the output gather them again when backward reaches it. In a backward (a
        recomputation for activation checkpointing) they stay until their gradients are in."""
        group = self._used[index]
        self._finished_calls.append(index)
        if torch.is_grad_enabled():
            tensors = [t for t in _torch_reshard.tensors_in(output) if t.requires_grad]
            ran = []  # the first of the outputs' gradients runs the hook, once

            def before_backward(_grad):
                if not ran:
                    ran.append(True)
                    self._before_backward(index)

            for tensor in tensors:
                tensor.register_hook(before_backward)
        if not self._in_backward:
            self._release_unless_functional(group)

    def _before_backward(self, index):
        """Backward reached a resharding group's module: gathers its parameters again (at
        the step's version) and prefetches those whose forwards ended before its."""
        if not self._in_backward:
            self._in_backward = True
            self._backward_prefetch = _torch_reshard.Prefetch(self._finished_calls[::-1], self._group_bytes)
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        group = self._used[index]
        try:
            self._gather_ahead(group, self._backward_prefetch, index)
            self._wait_gather(group)
        except flatshard.AbortedError:  # a load moved the servers: the step is void
            self._in_backward = False
            self._resume_after_load()
            raise
        except BaseException:
            self._in_backward = False
            self._settle_gathers()
            raise

    def _after_accumulate(self, group, fqn, param):
        """A resharding group's parameter has its gradient (in flat_grad: the parameter keeps
        none); once all have, the group's parameters are freed."""
        param.grad = None
        group.backward_done.add(fqn)
        if len(group.backward_done) == len(group.params):
            group.backward_done.clear()
            self._release(group)
            self._reap_scatters()

    def _after_backward(self):
        """The end of a backward: every resharding group's parameters are freed (those of
        parameters that got no gradient too), and the gradients sent are."""
        self._in_backward = False
        for group in self._used:
            group.backward_done.clear()
        self._release_all()
        self._reap_scatters()

    def _release_all(self):
        """Frees every resharding group's parameters that are held."""
        for group in self._used:
            if group.reshards:
                self._release(group)

    def _reap_scatters(self):
        """Frees the gradients of resharding groups whose scatter has finished; one that
        failed keeps its gradient and its error, which step() raises (and a step() after
        it sends the gradient again)."""
        still = []
        for group in self._scattering:
            pending = group.pending_scatter
            if pending is None:
                continue
            if not pending.done():
                still.append(group)
                continue
            group.pending_scatter = None
            try:
                pending.wait()
            except flatshard.AlreadyExistsError:  # a resend: every server has it already
                pass
            except BaseException as e:  # noqa: BLE001 (step() raises it)
                group.scatter_error = e
                continue
            group.sent = True
            group.release_grad()
        self._scattering = still

    def _on_grad(self, group, fqn, grad):
        if group.pending_scatter is not None or group.bucketed or group.sent:  # it would change what was sent
            raise flatshard.FailedPreconditionError(
                f"group '{group.name}' was already sent for step {self._step}: call step() "
                "before the next backward, or run the earlier micro-batches under no_sync()")
        if not group.grad_resident:  # freed once last sent (reshard_after_forward)
            group.restore_grad()
        target = group.grad_views[fqn]
        grad = grad.detach()
        if self._grad_scale != 1.0:  # unscaled in fp32, then into the reduce dtype
            grad = grad.float() * (1.0 / self._grad_scale)
        if fqn in group.accumulated:  # an earlier micro-batch's gradient is there
            target.add_(grad)
        else:
            target.copy_(grad)
            group.accumulated.add(fqn)
        if not self._accumulating:
            group.seen.add(fqn)
            if len(group.seen) == len(group.params):
                self._scatter(group)
        return None

    def set_hyperparams(self, param_group=None, **changes):
        """New optimizer hyper-parameters from the next step on, as a learning-rate
        schedule sets torch's param_groups: set_hyperparams(lr=1e-4) for every trained
        parameter, set_hyperparams(param_group=k, lr=1e-4) for those of param_groups[k]
        alone. The servers apply them to the step that the next step() completes."""
        if param_group is not None and (not isinstance(param_group, int) or
                                        not 0 <= param_group < self._param_group_count):
            raise flatshard.InvalidArgumentError(
                f"param_group {param_group!r}: the module has {self._param_group_count} param_groups")
        self._send_hyperparams([group for group in self._groups
                                if param_group is None or group.param_group == param_group], changes)

    def _param_group_members(self, k):
        """The trained groups of param group k as ServerOptimizer and optim_state_dict
        number them: 0 holds the parameters in no param_groups entry, k > 0 entry k - 1."""
        entry = None if k == 0 else k - 1
        return [group for group in self._groups if group.param_group == entry]

    def _send_hyperparams(self, groups, changes):
        if groups:  # one call per server for all of them
            self._client.set_hyperparams_of([group.name for group in groups], **changes)

    @contextlib.contextmanager
    def full_params(self):
        """The module's parameters and buffers at the servers' version for the block, as
        FSDP's summon_full_params(writeback=False) gives them: between steps, the module
        otherwise holds what its last forward gathered (the values before the last step),
        or, with reshard_after_forward, nothing. Every group is gathered (the pending ones
        settle before an error is raised); after the block the resharding groups are freed
        again, the others kept for the next forward. Changes made in the block do not
        reach the servers (load_state_dict() pushes values). Not inside forward or
        backward::

            with model.full_params():
                torch.save(model.module.state_dict(), "weights.pt")
        """
        if self._in_backward:
            raise flatshard.FailedPreconditionError("full_params() inside a backward")
        gather = [group for group in self._used if self._needs_gather(group)]
        buffers = self._buffer_group
        if buffers is not None and buffers.pending_gather is None and buffers.gathered_step != self._step:
            gather.append(buffers)
        self._issue_gathers(gather)
        try:
            errors = []
            for group in self._used + ([buffers] if buffers else []):
                try:
                    self._wait_gather(group)
                except Exception as e:  # noqa: BLE001 (raised below)
                    errors.append(e)
            if errors:
                raise errors[0]
            if buffers in gather:
                buffers.unpack()
            yield self
        finally:
            self._release_all()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation (FSDP's and DDP's no_sync()): backward passes inside add
        their gradients into the local flat gradient buffers and send nothing. The first
        backward after the block adds its own and sends the sum, group by group as
        usual; step() sends whatever is left. Gradients are summed, as torch sums them:
        scale each micro-batch's loss for a mean."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def _scatter(self, group):
        """Sends the group's gradient: a small one once the bucket is full (or at step()),
        a large one at once."""
        size = group.flat_grad.numel() * group.flat_grad.element_size()
        if size > _BUCKET_GROUP_BYTES:
            group.pending_scatter = self._client.scatter_async(
                group.name, group.grad_buffer, self._step, _NAMES[group.reduce_dtype])
            if group.reshards:
                self._scattering.append(group)
            return
        group.bucketed = True
        if self._bucket.add(group, size):
            self._send_bucket()

    def _send_bucket(self):
        bucket = self._bucket.groups
        self._bucket.clear()
        for dtype, members in _by_dtype(bucket, lambda group: group.reduce_dtype).items():  # a call per dtype
            transfers = self._client.scatter_many_async([group.name for group in members],
                                                        [group.grad_buffer for group in members], self._step, dtype)
            for group, transfer in zip(members, transfers):
                group.bucketed = False
                group.pending_scatter = transfer
                if group.reshards:
                    self._scattering.append(group)

    def forward(self, *args, **kwargs):
        if self._param_dtype != torch.float32:  # MixedPrecision casts floating inputs too
            args, kwargs = _cast_floats(args, self._param_dtype), _cast_floats(kwargs, self._param_dtype)
        self._voided = False
        self._in_backward = False  # one that raised never reached its end
        if self._hyperparams_from is not None:  # a scheduler's changes, for this step on
            self._hyperparams_from._send()
        try:
            self._gather_all()
            watch = (_torch_reshard.GatherOnUse(self._owners, self._gather_for_use) if self._watching
                     else contextlib.nullcontext())
            with watch:
                output = self.module(*args, **kwargs)
            if self._watching:  # a gather of a group its forward did not use ends here, not in step()
                for group in self._used:
                    self._wait_gather(group)
            if not torch.is_grad_enabled():  # no backward follows: what was gathered ahead is freed
                self._release_all()
            return output
        except flatshard.AbortedError:
            self._resume_after_load()
            raise
        except BaseException:
            self._settle_gathers()
            raise

    def _settle_gathers(self):
        """After a failed forward: waits out every gather still in flight (none may write
        into a buffer the next forward gathers into again), so that the next forward
        issues again exactly those that failed. Their errors are dropped: the forward's
        own is being raised."""
        for group in self._used:
            try:
                self._wait_gather(group)
            except Exception:  # noqa: BLE001 (reported by the failed forward)
                pass

    def step(self):
        """Sends what backward did not (unused parameters count as zero gradients), waits
        until every group reaches the next version, and clears the gradients. If it
        raises (a transfer failed, a deadline passed), calling it again sends only the
        gradients that did not arrive (or whose answer was lost: the servers say they
        hold them) and waits again.

        If a checkpoint load moved the servers to another version during the step (here
        or in forward), it raises AbortedError with the step's gradients dropped and the
        module at the loaded version (``version``): the next forward trains on from
        there (a step() before it is refused: it would send zeros for the voided step)."""
        if self._voided:
            raise flatshard.FailedPreconditionError(
                f"a checkpoint load voided the last step; the module is at version {self._step}: "
                "run forward and backward on the next batch before step()")
        for group in self._frozen + self._frozen_wrapped:  # unfrozen after wrapping: its gradient would go nowhere
            for fqn, param in group.params:
                if param.grad is not None:
                    raise flatshard.FailedPreconditionError(
                        f"parameter '{fqn}' has a gradient, but it was frozen (requires_grad=False) when the "
                        "module was wrapped and is never trained: set requires_grad before wrapping (to go on "
                        "from here, wrap a new instance of the model in another job and load_state_dict() "
                        "this module's state_dict() into it)")
        try:
            self._send_and_wait()
        except flatshard.AbortedError:
            self._resume_after_load()
            raise
        except flatshard.FailedPreconditionError as refused:  # a future step after a load back?
            version, step = self._servers_version(), self._step
            if version == step:
                raise
            self._resume_after_load()
            raise self._moved(version, step) from refused
        for group in self._groups:
            group.sent = False
            group.seen.clear()
            group.accumulated.clear()
            if group.reshards and group.grad_resident:
                group.release_grad()
        for group in self._used:
            group.eager = not group.fired or group.functional
            group.fired = False
        self._watching = False  # a step was watched: its forwards' order and uses are known
        self._scattering.clear()
        if self._buffer_group:
            self._buffer_group.sent = False
        self._step += 1
        self._grad_scale = 1.0
        self._clear_grads()

    def _send_and_wait(self):
        """Sends the step's gradients and waits for the next version. Of several
        transfers' errors it raises an ABORTED one (a load voided the step) first."""
        for group in self._groups:
            if group.pending_scatter is None and not group.bucketed and not group.sent and group.scatter_error is None:
                if not group.grad_resident:
                    group.restore_grad()
                for fqn, _ in group.params:
                    if fqn not in group.accumulated:
                        group.grad_views[fqn].zero_()
                self._scatter(group)
        buffers = self._buffer_group
        if buffers is not None and buffers.pending_scatter is None and not buffers.sent and not buffers.bucketed:
            buffers.pack()  # what this step's forwards left in them
            buffers.bucketed = True  # with the last bucket (its fp32 call)
            self._bucket.add(buffers, 0)
        self._send_bucket()
        error = None
        for group in self._stepped():  # every transfer settles before any error is raised
            if group.scatter_error is not None:  # found finished during backward
                e, group.scatter_error = group.scatter_error, None
                if error is None or isinstance(e, flatshard.AbortedError):
                    error = e
                continue
            if group.pending_scatter is None:
                continue  # sent by an earlier call
            pending, group.pending_scatter = group.pending_scatter, None
            try:
                pending.wait()
                group.sent = True
            except flatshard.AlreadyExistsError:  # a resend: every server has it already
                group.sent = True
            except BaseException as e:  # noqa: BLE001 (raised below)
                if error is None or isinstance(e, flatshard.AbortedError):
                    error = e
                if isinstance(e, KeyboardInterrupt):  # the rest need not finish either
                    for other in self._stepped():
                        if other.pending_scatter is not None:
                            other.pending_scatter.cancel()
        if error is not None:
            raise error
        # One call per server for every group. Past the next version only if a load moved
        # the group: this worker's next gradient makes the one after.
        names = [group.name for group in self._stepped()]
        for reached in (self._client.wait_versions(names, self._step + 1) if names else []):
            if reached != self._step + 1:
                raise self._moved(reached, self._step)
        for group in self._used:
            self._wait_gather(group)  # a prefetch nobody waited for: its buffer is ours again

    def _resume_after_load(self):
        """A checkpoint load replaced the servers' state mid-step (the servers answered
        ABORTED): what this step gathered and accumulated is void. Resumes at the loaded
        version, so that the next forward gathers it."""
        self._settle_gathers()
        for group in self._stepped():  # a backward that raised may have left gradients in flight
            pending, group.pending_scatter, group.scatter_error = group.pending_scatter, None, None
            if pending is not None:
                try:
                    pending.wait()
                except Exception:  # noqa: BLE001 (the step is void either way)
                    pass
        self._scattering.clear()
        self._bucket.clear()  # what waited there is void too
        for group in self._groups:  # step() has settled every scatter
            group.bucketed = False
            group.sent = False
            group.seen.clear()
            group.accumulated.clear()
            group.fired = False
            group.gathered_step = None
        for group in self._frozen_wrapped:  # the load may have changed them too
            group.fired = False
            group.gathered_step = None
        if self._buffer_group:
            self._buffer_group.bucketed = False
            self._buffer_group.sent = False
            self._buffer_group.gathered_step = None  # the load's, at the next forward
        self._step = self._servers_version()
        self._grad_scale = 1.0
        self._clear_grads()
        self._gather_frozen()  # the load may have changed them too
        self._voided = True

    def _servers_version(self):
        stepped = self._stepped()
        return self._client.version(stepped[0].name) if stepped else 0

    def _clear_grads(self):
        for param in self._params:
            param.grad = None

    def grad_norm(self):
        """The total gradient norm of the last step(), before clipping, as
        torch.nn.utils.clip_grad_norm_ returns it (the job must set max_grad_norm or
        skip_nonfinite; inf or NaN: the servers skipped that step)."""
        if self._step == 0:
            raise flatshard.FailedPreconditionError("no step has been taken yet")
        return self._client.grad_norm(self._step - 1)

    def optim_state_dict(self):
        """The servers' optimizer state as a torch optimizer's state_dict, keyed by
        parameter name as FSDP's optim_state_dict keys it::

            {"state": {fqn: {"step": tensor(3.), "exp_avg": ..., "exp_avg_sq": ...}},
             "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}, ...]}

        (SGD: "momentum_buffer"; nothing before the first step, as torch's.) param_groups
        are ServerOptimizer's: the parameters in no ``param_groups`` entry, then entry k at
        k + 1, with the settings the servers run now. Shared parameters appear once, under
        their first name; frozen ones have no state. It is read through
        ``export_state_dict(optimizer=True)`` into a temporary directory on this machine,
        whose disk the model and its state pass through. ``load_optim_state_dict``
        restores it (``torch.save`` it beside ``state_dict()``)."""
        arrays, metadata = {}, {}
        if self._groups:  # a module without trained parameters has no state to export
            with tempfile.TemporaryDirectory(prefix="flatshard-optim-") as directory:
                self._client.export_state_dict(directory, kind="full", optimizer=True)
                arrays, metadata = _safetensors.read_floats(directory, "optimizer")
        state = {}
        for group in self._groups:
            steps = int(metadata[f"{group.name}.step"])
            adam = metadata[f"{group.name}.optimizer"] in ("adam", "adamw")
            # Whether its state has begun: Adam's with its first step, SGD's momentum with
            # the first step that had momentum (or a load of momentum buffers).
            initialized = metadata.get(f"{group.name}.momentum_initialized")
            begun = steps > 0 if adam or initialized is None else initialized == "true"
            for fqn, _ in group.params:
                saved = {"step": torch.tensor(float(steps))} if adam and steps else {}
                for name in _STATES:
                    if begun and f"{fqn}.{name}" in arrays:
                        saved[name] = torch.from_numpy(arrays[f"{fqn}.{name}"])
                state[fqn] = saved
        param_groups = []
        for k, setting in enumerate(self._entry_settings):
            groups = self._param_group_members(k)
            current = self._client._optimizers.get(groups[0].name, setting) if groups else setting
            param_groups.append(dict(dataclasses.asdict(current),
                                     params=[fqn for group in groups for fqn, _ in group.params]))
        return {"state": state, "param_groups": param_groups}

    def load_optim_state_dict(self, optim_state_dict):
        """Restores the servers' optimizer state from a dict of ``optim_state_dict()``'s form
        (FSDP's: keyed by parameter name, a shared one under any of its names): each trained
        parameter's moments (SGD: momentum buffer), and each flat parameter's Adam step
        count, which its parameters share (their "step" must agree). A flat parameter none
        of whose parameters has state starts afresh, as a torch optimizer before its first
        step. ``param_groups`` are left to ``ServerOptimizer.load_state_dict``. The
        parameters keep their values.

        It goes through the servers' checkpoints: the module's state is exported into a
        temporary directory on this machine, its optimizer file rewritten with the given
        state, imported as a checkpoint of a random name (servers started with
        ``--checkpoint_root``), loaded and deleted. Call it between steps, with every
        worker at the same step (on one worker, or on each: every load is the same); the
        module resumes as after any load, gathering at its next forward."""
        state = optim_state_dict.get("state") if isinstance(optim_state_dict, dict) else None
        if not isinstance(state, dict):
            raise flatshard.InvalidArgumentError(
                "load_optim_state_dict takes a dict with a 'state' dict keyed by parameter name "
                "(optim_state_dict()'s form)")
        given = {self._aliases.get(key, key): value for key, value in state.items()}
        trained = {fqn for group in self._groups for fqn, _ in group.params}
        unknown = sorted(set(given) - trained)
        if unknown:
            raise flatshard.InvalidArgumentError(
                f"optimizer state for {unknown}, which are not trained parameters of this module")
        if not self._groups:
            return
        self._settle_gathers()
        name = f"optim-load-{uuid.uuid4().hex[:16]}"
        with tempfile.TemporaryDirectory(prefix="flatshard-optim-") as directory:
            self._client.export_state_dict(directory, kind="full", optimizer=True)
            arrays, metadata = _safetensors.read_floats(directory, "optimizer")
            for group in self._groups:
                _replace_optimizer_state(group, given, arrays, metadata)
            _safetensors.remove_files(directory, "optimizer")
            _safetensors.write_floats(os.path.join(directory, "optimizer.safetensors"), arrays, metadata)
            self._client.import_checkpoint(name, directory)
        try:
            self._client.load_checkpoint(name)
        finally:
            self._client.delete_checkpoint(name)
        self._resume_after_load()

    def state_dict(self, *args, **kwargs):
        """The full state dict read from the servers at the module's version: parameters
        in fp32, buffers (the workers' mean after the last step) in their own dtype."""
        out = collections.OrderedDict()
        # Every group's gather in flight at once (small ones in pipelines).
        stepped = self._stepped()
        names = [group.name for group in stepped]
        pending = list(zip(stepped, self._client.gather_many_async(names, self._step) if names else []))
        pending.extend((group, self._client.gather_async(group.name, 0))
                       for group in self._frozen + self._frozen_wrapped)
        for group, transfer in pending:
            flat, _ = transfer.wait()
            values = group.layout.views(flat)
            for fqn, tensor in group.params:
                value = torch.from_numpy(np.array(values[fqn]))
                out[fqn] = Buffers.cast(value, tensor) if group is self._buffer_group else value
        for alias, fqn in self._aliases.items():  # as torch's: shared tensors under each name
            out[alias] = out[fqn]
        order = [name for name in self.module.state_dict(keep_vars=True) if name in out]  # torch's
        return collections.OrderedDict([(name, out.pop(name)) for name in order] + list(out.items()))

    def load_state_dict(self, state_dict, strict=True):
        """Pushes a full state dict, parameters and buffers, to the servers (before the
        first step); the next forward gathers them. A shared parameter may come under any
        of its names; one left out (strict=False) keeps the servers' value, as torch's load
        leaves a parameter it does not name as it is."""
        names = set(itertools.chain.from_iterable([f for f, _ in g.params] for g in self._pushed_groups()))
        names |= set(self._aliases)
        missing = sorted(names - set(state_dict))
        unexpected = sorted(set(state_dict) - names)
        if strict and (missing or unexpected):
            raise flatshard.InvalidArgumentError(f"missing keys {missing}, unexpected keys {unexpected}")
        given = dict(state_dict)
        for alias, fqn in self._aliases.items():
            if fqn not in given and alias in given:
                given[fqn] = given[alias]
        # (Not the module's own tensors: resharded ones hold nothing.)
        if any(fqn not in given for group in self._pushed_groups() for fqn, _ in group.params):
            current = self.state_dict()
            given.update({fqn: value for fqn, value in current.items() if fqn not in given})
        self._push(self._pushed_groups(), lambda group: {
            fqn: torch.as_tensor(given[fqn]).detach().float() for fqn, _ in group.params})
        self._gather_frozen()
        for group in self._stepped() + self._frozen_wrapped:  # the next forward gathers the pushed values
            self._wait_gather(group)
            group.gathered_step = None
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


class ServerOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that stands for the servers' optimizer of a ShardedModule,
    so that torch's learning-rate schedulers (and code that sets
    ``param_groups[i]["lr"]``) drive it unchanged::

        optimizer = flatshard.torch.ServerOptimizer(model)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=1000)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()    # model.step()
            scheduler.step()

    ``param_groups[0]`` holds the parameters in none of the module's ``param_groups``
    entries, ``param_groups[k + 1]`` those of entry k, each with its optimizer's
    hyper-parameters under torch's names (Adam and AdamW: lr, betas, eps, weight_decay,
    amsgrad; SGD: lr, momentum, dampening, nesterov, weight_decay). What changes in them
    reaches the servers at the module's next forward (a call per server for each group
    changed), so it applies from the next step on, as torch's does. ``step()`` is the
    module's (a closure is called first, with grad enabled, and its loss returned);
    ``zero_grad()`` finds nothing left after a step; ``state_dict()`` reads the servers'
    state and ``load_state_dict()`` restores it (through the servers' checkpoint root), so
    ``torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f)`` and
    the matching loads resume training. It
    sends only what changes in its own ``param_groups``: change hyper-parameters through it
    or through ``ShardedModule.set_hyperparams``, not both."""

    def __init__(self, model):
        if not isinstance(model, ShardedModule):
            raise flatshard.InvalidArgumentError(
                f"ServerOptimizer stands for a flatshard.torch.ShardedModule's optimizer, not a {type(model).__name__}")
        groups = []
        for k, setting in enumerate(model._entry_settings):
            params = [param for group in model._param_group_members(k) for _, param in group.params]
            groups.append(dict(dataclasses.asdict(setting), params=params))
        self._model = model
        self._sent = [dataclasses.asdict(setting) for setting in model._entry_settings]
        super().__init__(groups, dataclasses.asdict(model._entry_settings[0]))
        model._hyperparams_from = self

    def _send(self):
        """Sends what changed in param_groups since the last call (ShardedModule.forward):
        param groups given the same changes (a scheduler's one factor on equal learning
        rates) in one call per server."""
        calls = []  # [changes, flat parameters, param groups' indexes]
        for k, (group, sent) in enumerate(zip(self.param_groups, self._sent)):
            changes = {key: group[key] for key in sent if group[key] != sent[key]}
            if not changes:
                continue
            members = self._model._param_group_members(k)
            call = next((call for call in calls if call[0] == changes), None)
            if call is None:
                calls.append([changes, members, [k]])
            else:
                call[1].extend(members)
                call[2].append(k)
        for changes, members, indexes in calls:
            self._model._send_hyperparams(members, changes)
            for k in indexes:
                self._sent[k].update(changes)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._model.step()
        return loss

    def state_dict(self):
        """The servers' optimizer state in torch's form, keyed by parameter name
        (``ShardedModule.optim_state_dict()``, FSDP's form), with the param_groups the
        servers run."""
        return self._model.optim_state_dict()

    def load_state_dict(self, state_dict):
        """Restores what state_dict() returned: the state on the servers
        (``ShardedModule.load_optim_state_dict``, between steps) and the param_groups'
        hyper-parameters, which reach the servers at the next forward as changes made here
        do (a scheduler's learning rate included)."""
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.param_groups):
            raise flatshard.InvalidArgumentError(
                f"the state dict has {len(saved) if isinstance(saved, list) else 'no'} param_groups; "
                f"this optimizer has {len(self.param_groups)}")
        self._model.load_optim_state_dict(state_dict)
        for group, given in zip(self.param_groups, saved):
            for key, value in given.items():
                if key != "params" and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value


def named_optim_state_dict(module, optimizer):
    """A torch optimizer's state_dict keyed by parameter name, the form
    ``ShardedModule.load_optim_state_dict`` and ``ServerOptimizer.load_state_dict`` take
    (FSDP's), rather than by position: what brings a run trained with torch alone onto
    flatshard with its optimizer state::

        model.load_state_dict(torch_model.state_dict())   # before the first step
        flatshard.torch.ServerOptimizer(model).load_state_dict(
            flatshard.torch.named_optim_state_dict(torch_model, torch_optimizer))

    `module` is the model `optimizer` trains (a shared parameter goes under its first
    name); param_groups keep their hyper-parameters."""
    names = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    saved = optimizer.state_dict()
    by_index = {}
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for param, index in zip(group["params"], saved_group["params"]):
            if id(param) not in names:
                raise flatshard.InvalidArgumentError(f"the optimizer trains a tensor of shape {tuple(param.shape)} "
                                                     "that is not a parameter of the module")
            by_index[index] = names[id(param)]
    return {"state": {by_index[index]: state for index, state in saved["state"].items()},
            "param_groups": [dict(group, params=[by_index[index] for index in group["params"]])
                             for group in saved["param_groups"]]}


class GradScaler:
    """Dynamic loss scaling for fp16 training (torch.cuda.amp.GradScaler's policy), with
    the servers deciding what a step with inf or NaN gradients does.

        client.configure_job(skip_nonfinite=True)    # needed: the servers skip such steps
        scaler = flatshard.torch.GradScaler(model)
        scaler.scale(loss).backward()   # the loss times the scale; each gradient is
                                        # divided by it (in fp32) before it is sent
        scaler.step()                   # model.step(), then the scale's update
                                        # (scaler.step(optimizer): a ServerOptimizer's)

    step() reads the step's gradient norm from the servers (every worker reads the same
    one, so every worker keeps the same scale): not finite, the servers skipped the step
    and the scale is multiplied by backoff_factor; after growth_interval finite steps in
    a row, by growth_factor. Use reduce_dtype=torch.float32 with float16 parameters, as
    unscaled gradients in float16 may underflow."""

    def __init__(self, model, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise flatshard.InvalidArgumentError(
                "GradScaler: init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                "growth_interval >= 1")
        self._model = model
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0

    def scale(self, loss):
        """`loss` times the current scale; the model unscales this step's gradients."""
        self._model._grad_scale = self._scale
        return loss * self._scale

    def step(self, optimizer=None):
        """model.step(), then the scale's update. Returns the step's gradient norm (inf or
        NaN when the servers skipped the step). ``step(optimizer)``, as torch's is called,
        takes the model's ServerOptimizer and steps through it, so that a learning-rate
        scheduler over it sees the step."""
        if optimizer is None:
            self._model.step()
        elif isinstance(optimizer, ServerOptimizer) and optimizer._model is self._model:
            optimizer.step()
        else:
            raise flatshard.InvalidArgumentError(
                f"GradScaler.step takes the ServerOptimizer of the scaler's model, not a {type(optimizer).__name__}")
        norm = self._model.grad_norm()
        if math.isfinite(norm):
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        else:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        return norm

    def get_scale(self):
        return self._scale

    def state_dict(self):
        return {"scale": self._scale, "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state):
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
