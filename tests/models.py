"""Small deterministic models and batches for the distributed tests.

Everything here is tiny on purpose: a test trains these for several steps at world
size 4 on two CPU cores, so one forward/backward must cost milliseconds.

[Note: fp32 Adam parity margin]
The parity tests ask FSDP training to end within rtol 1e-5 / atol 1e-6 of a
single-process run after 10 Adam steps at lr 1e-2. Data parallelism changes the
rounding of every gradient (per-rank partial sums, then a reduce-scatter whose
summation order is the collective's): about 3e-7 of a tensor's rms. Adam's first
update is lr * g / (|g| + eps), so an element whose gradient is ~1e-7 of typical
size flips by up to 2 * lr between two valid roundings: a "coin-flip" element, far
outside tolerance. How many such elements a run meets depends on the parameter count,
the init and the seeds. Measured on this model (emulating data parallelism in one
process with every summation order of 4 partial gradients a ring or tree collective
can use), GPT-2's N(0, 0.02) init at dim 32 fails with most seeds, while PyTorch's
default init at dim 16 passes with most. The defaults here (dim 16, model seed 0,
batch seed 1000) were picked from those that pass every order at world sizes 2 and 4
with the worst element at <= 0.16 of the tolerance; torch's FSDP1 over gloo lands
there too. A real bug (a gradient not reduced, scaled by W, or a stale shard) is off
by ~lr = 1e-2. If a valid change of arithmetic ever trips the tolerance by a few
elements, suspect this before the library, and re-pick seeds the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATOL",
    "Block",
    "CausalSelfAttention",
    "GPT",
    "MLP",
    "gpt_loss",
    "local_slice",
    "make_batch",
    "make_gpt",
    "PARITY",
    "RTOL",
    "SHAPES",
    "build_shape",
]

# The parity setting [Note: fp32 Adam parity margin] was measured at; every fp32
# parity test uses these. RTOL / ATOL: final parameters against the reference.
RTOL, ATOL = 1e-5, 1e-6
PARITY = dict(steps=10, lr=1e-2, model_seed=0, batch_seed=1000, global_batch=8, n_layers=3)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from plain Linear layers and matmul/softmax.

    The query/key/value projection has no bias on purpose: the gradient of a key bias
    is zero in exact arithmetic (it shifts every score of a query row by the same
    amount), so in floating point it is pure rounding noise, and Adam, which
    normalizes gradients, would turn that noise into full-size updates that no two
    reduction orders agree on.
    """

    def __init__(self, dim: int, n_heads: int, seq: int) -> None:
        super().__init__()
        if dim % n_heads != 0:
            raise ValueError(f"dim: expected a multiple of n_heads={n_heads} but got {dim}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        # Non-persistent buffer: not a parameter, FSDP must leave it alone.
        self.register_buffer(
            "causal_mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)  # [b, h, t, hd]
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        scores = scores.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v  # [b, h, t, hd]
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: the unit tests wrap one FSDP unit around."""

    def __init__(self, dim: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, seq)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embedding, Blocks, final LayerNorm, tied output head.

    ``head.weight`` IS ``embed.weight`` (one Parameter, two users), so with one unit
    per Block the root unit must own the tied weight. The position embedding ``pos`` is
    a parameter of the GPT module itself (not of a submodule), so the root unit's wrapped
    module holds a parameter directly: every test on this model goes through that case
    (its state-dict key is the wrapped module's own path). It is drawn as an
    ``nn.Embedding(seq, dim)`` would be, at the same point of the RNG stream.
    """

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.empty(seq, dim))
        self.reset_parameters()
        self.blocks = nn.ModuleList(Block(dim, n_heads, seq) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq:
            raise ValueError(f"tokens: expected at most {self.seq} positions but got {t}")
        x = self.embed(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [b, t, vocab]

    def reset_parameters(self) -> None:
        """The GPT's own parameter (``pos``), as ``nn.Embedding`` initializes its weight."""
        nn.init.normal_(self.pos)


def make_gpt(
    vocab: int = 64,
    dim: int = 16,
    n_layers: int = 3,
    n_heads: int = 4,
    seq: int = 16,
    seed: int = 0,
) -> GPT:
    """Build a GPT whose parameters depend only on the arguments.

    PyTorch's default initialization, drawn after ``torch.manual_seed(seed)``; the
    global RNG state is left untouched. See [Note: fp32 Adam parity margin] for why
    the defaults are what they are.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(vocab, dim, n_layers, n_heads, seq)


def make_batch(
    batch: int = 8, seq: int = 16, vocab: int = 64, seed: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch ``(tokens, targets)``, both int64 ``[batch, seq]``.

    ``targets`` is ``tokens`` shifted by one position (next-token prediction).
    """
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def local_slice(batch, rank: int, world_size: int):
    """Rank ``rank``'s contiguous rows of every tensor in ``batch`` (a tensor or tuple).

    Rows must divide evenly so that every rank's mean loss has the same weight.
    """
    if isinstance(batch, torch.Tensor):
        rows = batch.shape[0]
        if rows % world_size != 0:
            raise ValueError(
                f"batch: expected a row count divisible by world_size={world_size} but got {rows}"
            )
        n = rows // world_size
        return batch[rank * n : (rank + 1) * n]
    return tuple(local_slice(t, rank, world_size) for t in batch)


def gpt_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_gpt(model: nn.Module, opt, steps, rank: int, world_size: int, backward=None) -> list[float]:
    """One optimizer step per step number: next-token loss on this rank's rows of that step's global batch
    (``make_batch(seed=1000 + step)``), ``backward(loss)`` (default ``loss.backward()``); returns each step's
    loss averaged over the ranks (the global batch's)."""
    import torch.distributed as dist

    losses = []
    for step in steps:
        loss = gpt_loss(model, *local_slice(make_batch(seed=1000 + step), rank, world_size))
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


IMPLS = ["flatshard", "torch"]


def fsdp_class(impl: str):
    """The FullyShardedDataParallel class of ``impl``: flatshard's or torch's (FSDP1).

    Imported where called, so a flatshard that does not import fails the test
    (it is not skipped).
    """
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    if impl == "flatshard":
        from flatshard import FullyShardedDataParallel

        return FullyShardedDataParallel
    raise ValueError(f"impl: expected one of {IMPLS} but got {impl!r}")


class TiedLM(nn.Module):
    """Embedding tied to the output head, with a Linear between: the smallest tied model."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens)))


def param_mismatches(full: dict, want: dict, rtol: float, atol: float) -> list[str]:
    """Every way ``full`` (name -> tensor) differs from ``want``: names, then values."""
    problems = []
    if set(full) != set(want):
        problems.append(
            f"parameter names differ from the unwrapped model's: missing {sorted(set(want) - set(full))}, "
            f"unexpected {sorted(set(full) - set(want))}"
        )
    for name in sorted(set(full) & set(want)):
        try:
            torch.testing.assert_close(full[name], want[name], rtol=rtol, atol=atol)
        except AssertionError as e:
            problems.append(f"parameter {name!r}: {e}")
    return problems


# ----------------------------------------------------------- model shapes
# Where a unit's parameters sit decides the paths of their state-dict keys. These tiny
# models are the shapes users have; every data-path test (state dicts, checkpoints,
# optimizer state) runs on each. A unit "holds a parameter directly" when the module
# it wraps has it in its own ``_parameters`` (its key is the unit's own path).


class RootParam(nn.Module):
    """(a) The root's module holds a parameter itself (``scale``), beside a Linear leaf unit."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.register_buffer("offset", torch.arange(4.0) / 8)

    def forward(self, x):
        return self.lin(x) * self.scale + self.offset


class LeafUnits(nn.Module):
    """(b) Every unit a Linear: each wrapped module holds its parameters; the root holds none."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        return self.layers(x)


class Inner(nn.Module):
    """A unit holding a parameter directly (``gain``) with a nested Linear unit inside it."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.rand(4) + 0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.gain


class Body(nn.Module):
    """A plain module (never a unit): its parameter ``bias`` belongs to the root unit."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.rand(4))
        self.proj = nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x):
        return self.inner(self.proj(x)) + self.bias


class PlainParent(nn.Module):
    """(c) Units under a plain parent module (``body``), and a unit nested in a unit."""

    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, x):
        return self.body(x)


class Odd(nn.Module):
    """A unit of three elements: padded at every world size above 1 (one element at W=2 and 4)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return x * self.w


class Padded(nn.Module):
    """(d) A three-element unit (``odd``), and a Linear of 15 elements: both padded at W = 2 and 4; and a
    ``[1, 3]`` parameter on the root (a class token): one row, so at W >= 2 some ranks hold no chunk of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.odd = Odd()
        self.token = nn.Parameter(torch.rand(1, 3))

    def forward(self, x):
        return self.odd(self.lin(x)) + self.token


class Checkpointed(PlainParent):
    """(e) As ``PlainParent``, with activation checkpointing applied by hand before wrapping: the nested
    unit ``body.inner`` sits inside torch's checkpoint wrapper (its paths hold
    ``_checkpoint_wrapped_module``, which torch's FSDP1 drops from state-dict keys)."""

    def __init__(self):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        super().__init__()
        self.body.inner = checkpoint_wrapper(self.body.inner)


#: name -> (model class, the module classes each wrapped as its own unit by ModuleWrapPolicy)
SHAPES = {
    "root_param": (RootParam, (nn.Linear,)),
    "leaf_units": (LeafUnits, (nn.Linear,)),
    "plain_parent": (PlainParent, (nn.Linear, Inner)),
    "padded": (Padded, (nn.Linear, Odd)),
    "checkpointed": (Checkpointed, (nn.Linear, Inner)),
}


def build_shape(name: str, seed: int = 0) -> nn.Module:
    """A fresh model of shape ``name`` (see SHAPES) whose parameters depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SHAPES[name][0]()
