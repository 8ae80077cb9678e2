"""reshard_after_forward's pieces for flatshard.torch.ShardedModule: which groups to gather
ahead of their modules (Prefetch), the tensors of a module's output that backward reaches
(tensors_in), and the autograd function whose backward says that backward has gone
through a module (AfterBackward)."""

import torch

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
