"""reshard_after_forward's pieces for flatshard.torch.ShardedModule: which groups to gather
ahead of their modules (Prefetch), the tensors of a module's output that backward reaches
(tensors_in), the autograd function whose backward says that backward has gone
through a module (AfterBackward), and the torch function mode that finds parameters used
outside their module's forward (GatherOnUse; also without reshard_after_forward)."""

import itertools

import torch
from torch.overrides import TorchFunctionMode

# reshard_after_forward: the parameters gathered ahead of their module (the next group's
# always, and more while they fit): small groups' gathers go in pipelines.
PREFETCH_BYTES = 1 << 20


def tensors_in(value):
    """The tensors in `value`, nested in tuples, lists and dicts (a module's output)."""
    if torch.is_tensor(value):
        return [value]
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in values for t in tensors_in(v)]


class Prefetch:
    """Which resharding groups to gather ahead (reshard_after_forward), in `order` (group
    indices as the last forward ran them, or as its backward will: the reverse of the
    order their forwards ended): at a group's turn, the groups after it while their
    parameters fit in PREFETCH_BYTES (the next one always), topped up in one call once
    less than half of that is ahead, so that small groups go in pipelines. `sizes[i]`: the
    bytes of group i's parameters."""

    def __init__(self, order, sizes):
        self.order = order
        self.position = {}
        self.prefix = [0]  # bytes of order[:k]
        for k, index in enumerate(order):
            self.position.setdefault(index, k)
            self.prefix.append(self.prefix[-1] + sizes[index])
        self.issued = -1  # the last position of `order` whose gather was asked for

    def ahead(self, index):
        """The group indices to gather at group `index`'s turn (None: before the first);
        none for a group the order does not hold."""
        at = -1 if index is None else self.position.get(index)
        if at is None:
            return []
        start = max(self.issued, at) + 1
        if start > at + 1 and self.prefix[start] - self.prefix[at + 1] >= PREFETCH_BYTES / 2:
            return []
        end = start
        while end < len(self.order) and (
                end == at + 1 or self.prefix[end + 1] - self.prefix[at + 1] <= PREFETCH_BYTES):
            end += 1
        self.issued = max(self.issued, end - 1)
        return self.order[start:end]


class AfterBackward(torch.autograd.Function):
    """The identity on a module's inputs, whose backward calls `callback` once backward has
    gone through the module (the gradients of all those inputs are in): where a resharding
    frozen group is freed in backward, as FSDP's RegisterPostBackwardFunction frees one."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


# What a torch function may look at without using a parameter's values: its metadata,
# which a freed parameter gives as an empty tensor's in any step (properties by name, as
# their __get__ comes, and methods).
_METADATA = frozenset((
    "shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "names",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "is_nested", "output_nr", "_version",
    "numel", "nelement", "size", "dim", "ndimension", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "get_device", "__len__", "__hash__"))


def _looks_only(func):
    """Whether torch function `func` leaves its tensors' values alone: it sets a property
    (a parameter's .data, as groups are freed and restored) or reads metadata."""
    name = getattr(func, "__name__", None)
    if name == "__set__":
        return True
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name in _METADATA


class GatherOnUse(TorchFunctionMode):
    """A torch function mode for the forwards before the first step, which wait for each
    group's gather (and gather a resharding group) as its module's forward comes rather
    than up front: a torch function given a group's parameter (in its arguments, or in a
    list or tuple of them) calls `fetch(index)` first, which makes the group's parameters
    ready where they are not (a use outside its module's forward: MultiheadAttention's
    functional use of its out_proj, a use before the module runs or after a resharding
    module freed them). `owners`: id(parameter) to its group's index in the module's
    groups. Setting a parameter's .data (how groups are freed and restored) or reading its
    metadata (a hook summing numel(), say) is no use of it. Torch calls it with the mode
    off, so what `fetch` and `func` run is not watched again."""

    def __init__(self, owners, fetch):
        super().__init__()
        self.owners = owners
        self.fetch = fetch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _looks_only(func):
            for value in itertools.chain(args, kwargs.values()):
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    index = self.owners.get(id(item))
                    if index is not None:
                        self.fetch(index)
        return func(*args, **kwargs)
