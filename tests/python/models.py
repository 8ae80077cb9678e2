"""Small models and data shared by the Python tests (deterministic by seed)."""

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F


class TransformerBlock(nn.Module):
    """A pre-norm transformer block (2-head self-attention + MLP) with a linear head.

    The key projection has no bias: a bias on keys adds the same amount to every
    attention logit of a query, which softmax ignores, so its exact gradient is zero and
    its float gradient pure rounding noise that Adam would amplify into random steps.
    torch 1.13's nn.TransformerEncoderLayer cannot drop it, hence this block.
    """

    def __init__(self, dim=16, heads=2, hidden=32, checkpointed=False):
        super().__init__()
        self.heads = heads
        self.checkpointed = checkpointed  # the MLP's activations recomputed in backward
        self.embed = nn.Linear(6, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.embed(x)
        b, t, d = h.shape
        n = self.norm1(h)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.query(n)), split(self.key(n)), split(self.value(n))
        attention = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        h = h + self.out((attention @ v).transpose(1, 2).reshape(b, t, d))
        mlp = lambda t: self.mlp(self.norm2(t))
        h = h + (torch.utils.checkpoint.checkpoint(mlp, h, use_reentrant=False) if self.checkpointed else mlp(h))
        return self.head(h.mean(dim=1))


class RetargetedBlock(TransformerBlock):
    """The block fine-tuned for another task: its head dropped (Identity, no parameters)
    and a new two-layer ``task_head`` on top, so that TransformerBlock's checkpoint holds
    all of it but the new head, and a head it does not have."""

    def __init__(self, dim=16):
        super().__init__(dim=dim)
        self.head = nn.Identity()
        self.task_head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 4))

    def forward(self, x):
        return self.task_head(super().forward(x))


class AttentionModel(nn.Module):
    """nn.MultiheadAttention uses its out_proj functionally (out_proj.forward never runs),
    which ShardedModule must handle: no forward hook of that group ever fires."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(dim=1))


class TiedFrozenModel(nn.Module):
    """Input and output embeddings tied (one Parameter under two names, as GPT-2 does) and
    a frozen projection (requires_grad=False, as when fine-tuning): ShardedModule must keep
    one copy of the tied weight, and neither update nor send gradients for the frozen one."""

    def __init__(self, vocab=12, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, dim))
        self.unembed = nn.Linear(dim, vocab, bias=False)
        self.unembed.weight = self.embed.weight
        self.project = nn.Linear(vocab, 4)
        self.project.requires_grad_(False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.mlp(h)
        return self.project(self.unembed(h).mean(dim=1))


class BatchNormNet(nn.Module):
    """An MLP with BatchNorm1d, whose running statistics and num_batches_tracked are module
    buffers (in the state dict, updated by every forward in training mode), and a buffer
    registered with persistent=False, which the state dict leaves out. fc1 has no bias
    (as usual before BatchNorm): BatchNorm subtracts the batch mean, so such a bias's exact
    gradient is zero and its float gradient rounding noise that Adam would amplify."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class Chain(nn.Module):
    """Linear layers in a row, each a group of its own under auto_wrap_min_params=200, and
    a scale at the root: for reshard_after_forward, which holds each layer's parameters
    around its forward and its backward alone. At 192 features a layer's gradient (145 KiB)
    is sent as soon as backward reaches it rather than in the bucket of small ones."""

    def __init__(self, depth=4, dim=192):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.scale = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, 4)
        self.skip = set()  # indices of layers left out (a layer drop)

    def forward(self, x):
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                h = torch.tanh(layer(h))
        return self.head(h * self.scale)


class LoraLinear(nn.Module):
    """A frozen Linear with a trained low-rank update beside it (LoRA: base(x) + up(down(x)))."""

    def __init__(self, dim, rank):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class LoraChain(nn.Module):
    """Chain's layers as frozen Linears under trained low-rank adapters: under
    auto_wrap_min_params=200 each layer's adapters are a trained group and (with
    reshard_after_forward) its base a frozen group of its own."""

    def __init__(self, depth=4, dim=64, rank=2):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList(LoraLinear(dim, rank) for _ in range(depth))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


class ReusedWeights(Chain):
    """The chain, whose forward also uses two layers' weights outside their forwards: layer
    1's before its forward (a projection of the embedding), layer 0's after it (a read-out
    of the last hidden state). ShardedModule must find those uses in its first step (no
    hook of theirs says so): to wait for layer 1's gather before the forward, and with
    reshard_after_forward to hold both layers through every step."""

    def __init__(self):
        super().__init__(depth=3)

    def forward(self, x):
        h = self.embed(x)
        h = h + 0.1 * F.linear(h, self.layers[1].weight)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        h = h + 0.1 * F.linear(h, self.layers[0].weight)
        return self.head(h * self.scale)


def make_model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 4))
    if kind == "transformer":
        return TransformerBlock()
    if kind == "checkpointed":  # the same block under activation checkpointing
        return TransformerBlock(checkpointed=True)
    if kind == "retargeted":  # the transformer with a new head, for fine-tuning from its checkpoints
        return RetargetedBlock()
    if kind == "attention":
        return AttentionModel()
    if kind == "tied_frozen":
        return TiedFrozenModel()
    if kind == "batchnorm":
        return BatchNormNet()
    if kind == "chain":
        return Chain()
    if kind == "lora":
        return LoraChain()
    if kind == "reused":
        return ReusedWeights()
    raise ValueError(kind)


def make_data(kind, batch=16):
    generator = torch.Generator().manual_seed(1)
    if kind == "tied_frozen":  # token ids
        x = torch.randint(0, 12, (batch, 5), generator=generator)
        return x, torch.randn(batch, 4, generator=generator)
    x = torch.randn(batch, 8, generator=generator) if kind in ("mlp", "batchnorm", "chain", "lora", "reused") else \
        torch.randn(batch, 5, 6, generator=generator)
    y = torch.randn(batch, 4, generator=generator)
    return x, y


def make_scheduler(name, optimizer, steps):
    """A torch learning-rate scheduler by name, over torch's optimizer or
    flatshard.torch.ServerOptimizer alike."""
    if name == "onecycle":  # every group's lr and Adam's beta1 change at every step
        max_lr = [1e-2, 5e-3, 2e-2][:len(optimizer.param_groups)]
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=steps + 1)
    raise ValueError(name)
