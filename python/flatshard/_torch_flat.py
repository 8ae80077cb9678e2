"""The flat buffers flatshard.torch.ShardedModule moves: one flat parameter's values and
gradients, whose parameters are views into them (Group), the module's persistent buffers
as one group of the job (Buffers), and what the client is handed for a buffer
(client_buffer). Plain objects, used from the thread that runs the module."""

import collections
import ctypes

import numpy as np
import torch

import flatshard

NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}  # bf16: same bits


def client_buffer(tensor, resizable=False):
    """What the client reads or writes for `tensor` every step: a numpy view of a host
    tensor (bfloat16 as int16, the same bits), cheaper to hand over than the tensor's
    DLPack capsule, or the tensor itself on a GPU (DLPack, for the GPU data planes).
    `resizable`: a flat buffer whose storage reshard_after_forward frees and restores, which
    Tensor.numpy() would fix for good; the array is then over the memory's address and must
    be dropped before the storage is resized."""
    if tensor.is_cuda:
        return tensor
    if resizable:
        raw = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
        return np.frombuffer(raw, dtype=NUMPY[tensor.dtype])
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def untyped_storage(tensor):
    """The storage under flat buffer `tensor` (all of it), sized in bytes. Resizing it is how
    FSDP frees and restores its unsharded flat parameters: to 0 frees the memory while the
    tensor and its views (those autograd saved for backward among them) stay; back to the
    tensor's bytes gives it memory again, not initialized, which those views see."""
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage()
    return tensor.storage().untyped()  # torch before 2.0


class Group:
    """One flat parameter: `params` view `flat` (of param_dtype); gradients gather in
    `flat_grad` (of reduce_dtype; None for the frozen parameters' groups), each
    parameter's in its view of it (`grad_views`).
    `flat_buffer` and `grad_buffer` are what the client reads and writes
    (client_buffer). With ShardedModule's reshard_after_forward, `reshards` groups free
    `flat` between uses (release/restore) and `flat_grad` once it is sent
    (release_grad/restore_grad); the buffers are None while freed."""

    def __init__(self, name, path, module, params, layout, param_dtype, reduce_dtype, trained=True,
                 param_group=None, reshards=False):
        self.name = name
        self.path = path
        self.module = module
        self.param_group = param_group  # its entry of ShardedModule's param_groups (None: none)
        self.trained = trained  # stepped (else frozen: never sent a gradient, its version never moves)
        self.params = params  # [(fqn, nn.Parameter)] in layout order
        self.layout = layout
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # On the parameters' device: CUDA tensors move by CUDA IPC or staging (DLPack).
        device = params[0][1].device
        self.flat = torch.empty(layout.padded_numel, dtype=param_dtype, device=device)
        self.flat_grad = (torch.zeros(layout.padded_numel, dtype=reduce_dtype, device=device)
                          if trained else None)
        self.flat_buffer = client_buffer(self.flat, resizable=reshards)
        self.grad_buffer = client_buffer(self.flat_grad, resizable=reshards) if trained else None
        self.flat_storage = untyped_storage(self.flat) if reshards else None
        self.grad_storage = untyped_storage(self.flat_grad) if reshards and trained else None
        self.grad_views = {}  # fqn: its gradient's view of flat_grad, of its parameter's shape
        self.pending_gather = None
        self.gathered_step = None  # the step whose gather was issued last
        self.pending_scatter = None
        self.bucketed = False  # its gradient waits in the module's bucket to be sent
        self.sent = False         # its gradient for the step arrived (step() may be retried)
        self.seen = set()         # parameters whose gradient this backward delivered
        self.accumulated = set()  # parameters whose gradient flat_grad holds for the step
        # Wait for its gather before the forward: its parameters were used outside its
        # module's forward, or its module's forward did not run (set by each step(), from
        # what its forwards' hooks and the first step's GatherOnUse saw).
        self.eager = False
        self.fired = False  # its module's pre-hook ran in this step
        self.functional = False  # its parameters were used outside its module's forward (once is enough)
        self.reshards = reshards  # frees flat after its forward and flat_grad once sent (ShardedModule)
        self.resident = True  # flat holds memory
        self.grad_resident = trained  # flat_grad holds memory
        self.views = {}  # fqn: its parameter's view of flat (what param.data is while resident)
        self.accumulators = []  # its parameters' AccumulateGrad nodes, kept for their hooks (reshards)
        self.backward_done = set()  # parameters whose gradient this backward accumulated (reshards)
        self.scatter_error = None  # of a scatter found finished before step() (reshards), for step() to raise
        offsets = {t["name"]: (t["offset"], t["numel"]) for t in layout.tensors}
        with torch.no_grad():
            for fqn, param in params:
                offset, numel = offsets[fqn]
                view = self.flat[offset:offset + numel].view(param.shape)
                view.copy_(param.detach())
                param.data = view
                self.views[fqn] = view
                if trained:
                    self.grad_views[fqn] = self.flat_grad[offset:offset + numel].view(param.shape)

    def release(self):
        """Frees flat's memory (no gather may be in flight into it). The parameters become
        empty tensors until restore(), so that a use of them before it fails on their
        shape rather than reading freed memory; autograd's views of flat keep theirs."""
        empty = self.flat.new_empty(0)
        for _, param in self.params:
            param.data = empty
        self.flat_storage.resize_(0)
        self.flat_buffer = None
        self.resident = False

    def restore(self):
        """Gives flat memory again (not initialized: a gather fills it) and the parameters
        their views of it."""
        self.flat_storage.resize_(self.flat.numel() * self.flat.element_size())
        self.flat_buffer = client_buffer(self.flat, resizable=True)
        for fqn, param in self.params:
            param.data = self.views[fqn]
        self.resident = True

    def release_grad(self):
        """Frees flat_grad's memory (its scatter has finished)."""
        self.grad_storage.resize_(0)
        self.grad_buffer = None
        self.grad_resident = False

    def restore_grad(self):
        """Gives flat_grad memory again, zeroed (its padding is sent as it is)."""
        self.grad_storage.resize_(self.flat_grad.numel() * self.flat_grad.element_size())
        self.flat_grad.zero_()
        self.grad_buffer = client_buffer(self.flat_grad, resizable=True)
        self.grad_resident = True


class Buffers:
    """The module's persistent buffers (BatchNorm's running statistics: what its
    state_dict holds besides parameters) as one group of the job with optimizer Average:
    each step every worker sends its buffers (`pack`), the servers keep their mean, and the
    next forward gathers it back (`unpack`), so the buffers are the same on every worker
    and in the servers' checkpoints at each version. Held in fp32 on the servers (an
    integer buffer, num_batches_tracked, is exact up to 2**24).

    The module's buffers become views: fp32 ones of the flat buffer that gathers fill and
    steps send (nothing to copy), the others of one tensor per dtype, cast into the flat
    buffer and back in one operation each. A buffer the module replaced (an assignment,
    module.to()) is taken in at the next pack or unpack and made a view again. Has the
    attributes ShardedModule's gather and scatter code reads from a Group."""

    def __init__(self, name, entries, layout):
        self.name = name
        self.entries = entries  # [(fqn, owning module, attribute)]
        self.layout = layout
        device = getattr(entries[0][1], entries[0][2]).device
        self.flat = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        self.flat_buffer = client_buffer(self.flat)
        self.grad_buffer = self.flat_buffer  # what a step sends: the values themselves
        self.param_dtype = self.reduce_dtype = torch.float32  # gathered and sent as held
        self.pending_gather = None
        self.gathered_step = None
        self.pending_scatter = None
        self.bucketed = False
        self.sent = False
        self.scatter_error = None
        self.trained = True  # stepped: its version says what a load did
        self.reshards = False  # held (gathered once per step, sent by step())
        self.resident = True
        offsets = {t["name"]: (t["offset"], t["numel"]) for t in layout.tensors}
        by_dtype = collections.defaultdict(list)
        for fqn, owner, attr in entries:
            by_dtype[owner._buffers[attr].dtype].append((fqn, owner._buffers[attr].shape))
        views = {}  # fqn: the view the module's buffer is
        self.others = []  # [(tensor of another dtype, the positions of its elements in flat)]
        for dtype, members in by_dtype.items():
            if dtype == torch.float32:
                for fqn, shape in members:
                    offset, numel = offsets[fqn]
                    views[fqn] = self.flat[offset:offset + numel].view(shape)
                continue
            positions = [i for fqn, _ in members for i in range(offsets[fqn][0], sum(offsets[fqn]))]
            values = torch.empty(len(positions), dtype=dtype, device=device)
            start = 0
            for fqn, shape in members:
                views[fqn] = values[start:start + offsets[fqn][1]].view(shape)
                start += offsets[fqn][1]
            self.others.append((values, torch.tensor(positions, dtype=torch.long, device=device)))
        self.links = [views[fqn] for fqn, _, _ in entries]
        self._relink(take_values=True)

    @property
    def params(self):
        """[(fqn, tensor)]: the module's buffers now, as Group.params lists parameters."""
        return [(fqn, owner._buffers[attr]) for fqn, owner, attr in self.entries]

    def _relink(self, take_values):
        """Makes every buffer the module replaced a view again, with its values if
        `take_values` (else with what the views hold)."""
        with torch.no_grad():
            for (fqn, owner, attr), view in zip(self.entries, self.links):
                buffer = owner._buffers[attr]
                if buffer is view:
                    continue
                if buffer is None or buffer.shape != view.shape:
                    raise flatshard.FailedPreconditionError(
                        f"buffer '{fqn}' is now {None if buffer is None else tuple(buffer.shape)}, but it was "
                        f"{tuple(view.shape)} when the module was wrapped: wrap a new instance of the model")
                if take_values:
                    view.copy_(buffer)
                owner._buffers[attr] = view

    def pack(self):
        """Puts the module's buffers into the flat buffer that step() sends."""
        self._relink(take_values=True)
        with torch.no_grad():
            for values, positions in self.others:
                self.flat.index_copy_(0, positions, values.float())

    def unpack(self):
        """Gives the module's buffers what a gather put into the flat buffer."""
        self._relink(take_values=False)
        with torch.no_grad():
            for values, positions in self.others:
                gathered = self.flat.index_select(0, positions)
                values.copy_(gathered if values.is_floating_point() else gathered.round())

    @staticmethod
    def cast(values, like):
        """fp32 `values` in the shape and dtype of buffer `like` (integers rounded)."""
        if not like.is_floating_point():
            values = values.round()
        return values.reshape(like.shape).to(like.dtype)
