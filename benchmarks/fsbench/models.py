"""The benchmarks' models and data: built the same way for every peer.

Every peer gets a model from the same constructor under the same seed, so all
peers start from identical weights and see identical batches. A *unit* is one
``unit_cls`` instance (one transformer block, one tiny layer) plus the root.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MODEL_SEED = 0
DATA_SEED = 1234


# --------------------------------------------------------------------------- GPT
class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT with a tied token embedding / output head (the tie lives in the root unit)."""

    def __init__(self, vocab: int, seq_len: int, dim: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        for m in self.modules():  # GPT-2 style init
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------- many small units
class TinyLayer(nn.Module):
    """One tiny residual layer: compute is negligible, so per-unit overhead shows."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class TinyStack(nn.Module):
    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(TinyLayer(dim) for _ in range(n_layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


# ------------------------------------------------------------ one blob (collectives)
class Blob(nn.Module):
    """A single parameter of ``numel`` fp32 elements: a one-unit model of a given size."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight[: x.numel()] * x).sum()


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelSpec:
    """What every peer needs to build and train one workload's model."""

    name: str
    build: Callable[[], nn.Module]  # same weights on every call (seeded)
    unit_cls: type[nn.Module]  # one FSDP unit per instance, plus the root
    n_units: int  # unit_cls instances + the root
    make_batch: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]  # (gen, n) -> (x, y)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tokens_per_sample: int  # for throughput (1 for non-sequence models)


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            return fn()

    return build


def gpt_spec(*, vocab: int = 512, seq_len: int = 64, dim: int = 128, n_layers: int = 8, n_heads: int = 4,
             batch_seq_len: int | None = None) -> ModelSpec:
    """GPT workload; ``batch_seq_len`` shortens the sequences of a batch (memory runs)."""
    t = batch_seq_len or seq_len

    def make_batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab, (n, t + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return ModelSpec(
        name="gpt",
        build=_seeded(lambda: GPT(vocab, seq_len, dim, n_layers, n_heads)),
        unit_cls=Block,
        n_units=n_layers + 1,
        make_batch=make_batch,
        loss=loss,
        tokens_per_sample=t,
    )


def gpt_large_spec() -> ModelSpec:
    """The GPU workload: a GPT of 0.54 B parameters (24 blocks of width 1280, GPT-2's
    vocabulary padded to 50304, 1024 positions), trained on full 1024-token sequences."""
    return dataclasses.replace(gpt_spec(vocab=50304, seq_len=1024, dim=1280, n_layers=24, n_heads=20),
                               name="gpt-large")


def tiny_stack_spec(*, dim: int = 16, n_layers: int = 64) -> ModelSpec:
    def make_batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)

    return ModelSpec(
        name="many-small-units",
        build=_seeded(lambda: TinyStack(dim, n_layers)),
        unit_cls=TinyLayer,
        n_units=n_layers + 1,
        make_batch=make_batch,
        loss=F.mse_loss,
        tokens_per_sample=1,
    )


def make_batches(spec: ModelSpec, count: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches, identical in every process (fixed generator)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [spec.make_batch(gen, global_batch) for _ in range(count)]


def local_slice(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of a global batch (the global batch divides by W)."""
    x, y = batch
    n = x.shape[0] // world_size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def param_bytes(module: nn.Module) -> int:
    """Bytes of distinct parameters (a tied weight counts once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def unit_param_bytes(spec: ModelSpec) -> tuple[int, list[int]]:
    """(root unit's own parameter bytes, each unit_cls instance's parameter bytes)."""
    model = spec.build()
    units = [m for m in model.modules() if isinstance(m, spec.unit_cls)]
    in_units = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_units)
    return root, [param_bytes(u) for u in units]
