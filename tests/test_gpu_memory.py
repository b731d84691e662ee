"""GPU memory of a training step within its analytic bound, at every limiter setting.

Skipped without CUDA. ``torch.cuda.max_memory_allocated`` over one step (forward,
backward, AdamW step, zero_grad), relative to what was allocated before the model
was wrapped, against what FULL_SHARD must hold ([Note: The step's memory bound]).
NCCL at world size 1 (every unit has shard factor 1: nothing is gathered) and gloo
at world size 2 on one GPU (see tests/test_gpu.py for what that route exercises),
with ``FLATSHARD_ALL_GATHER_LIMIT`` 1 and 2 and with ``limit_all_gathers=False``.
The allocator must never have had to free its cache and retry
(``num_alloc_retries`` stays 0).

[Note: The step's memory bound]
With S the sum of every unit's padded flat shard in bytes (fp32), F_max the
largest unit's unsharded bytes and F_root the root unit's:
- between steps: 3 S (parameter shards, AdamW's two moments; ``.grad`` is None);
- during the step, on top of that: S (gradient shards); the root unit, kept
  unsharded from forward into backward, and two layers (the one computing and the
  one prefetched; forward_prefetch and BACKWARD_PRE gather one unit ahead, whatever
  the limiter allows): F_root + 2 F_max, none at world size 1; two unsharded
  gradients (autograd's per-parameter gradients of the unit whose backward ended,
  and the flat gradient they are copied into: the previous unit's is released
  before): 2 F_max; AdamW's per-parameter temporaries (``foreach=False``, one flat
  shard at a time): 2 S_max; activations: 3 rows x DIM per layer plus 4 for the
  loss, saved or transient (analytic; tiny at this batch); and 1 MiB for the
  caching allocator, which counts whole blocks: it rounds to 512 bytes and does
  not split off a remainder of 1 MiB or less, so a block can exceed its request
  (measured on an H100: 44 KiB over the 27 blocks of the state at world size 2).
Between steps the state must also stay the same to the byte from one step to
the next (nothing accumulates).
The limiter does not change that count on a GPU: a buffer freed on the host can
be reused at once by the next all-gather, which is ordered after the compute
queued before it; the limiter bounds how far the host runs ahead of the device.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed

pytestmark = pytest.mark.gpu

N_LAYERS = 8
DIM = 1024  # a 4 MiB Linear per layer
BATCH = 8  # rows per rank
EXTRA = 1024  # layer i holds EXTRA * (i + 1) more elements: units of different sizes
MIB = 2**20


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.extra = nn.Parameter(torch.zeros(EXTRA * (index + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.extra.sum()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)  # the root unit's own parameter
        self.layers = nn.ModuleList(Layer(i) for i in range(N_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def bound(world_size: int) -> dict:
    """[Note: The step's memory bound] for this model, in bytes."""
    root = DIM * DIM
    layers = [DIM * DIM + DIM + EXTRA * (i + 1) for i in range(N_LAYERS)]
    padded = [-(-n // world_size) * world_size * 4 for n in [root, *layers]]
    shards = [p // world_size for p in padded]
    s, f_max = sum(shards), max(padded)
    state = 3 * s
    in_flight = padded[0] + 2 * max(padded[1:]) if world_size > 1 else 0
    activations = (3 * N_LAYERS + 4) * BATCH * DIM * 4
    step = s + in_flight + 2 * f_max + 2 * max(shards) + activations + MIB
    return {"state": state + MIB, "peak": state + step}


def _measure(rank: int, world_size: int, backend: str, limit: int | None) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if backend == "nccl" else None
    if limit is not None:
        os.environ["FLATSHARD_ALL_GATHER_LIMIT"] = str(limit)
    x = torch.randn(BATCH, DIM, device=device)
    # cuBLAS's and cuBLASLt's workspaces (Lt: 1 MiB, for a Linear with bias) are the process's,
    # made by the first matrix product of each kind: before the baseline.
    w = torch.randn(DIM, DIM, device=device, requires_grad=True)
    b = torch.zeros(DIM, device=device, requires_grad=True)
    (torch.nn.functional.linear(x, w, b).sum() + (x @ w).sum()).backward()
    del w, b
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    artifacts = os.environ.get("FLATSHARD_TEST_ARTIFACTS")
    if artifacts and rank == 0:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Stack()
    model = FSDP(model, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Layer}), device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch=True, limit_all_gathers=limit is not None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # creates AdamW's state; the second step runs with prefetch
        step()
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    if artifacts and rank == 0:
        name = f"memory_{backend}_w{world_size}_limit{limit}.pickle"
        torch.cuda.memory._dump_snapshot(os.path.join(artifacts, name))
    return {
        "state": state,
        "state_after": torch.cuda.memory_allocated() - base,
        "peak": torch.cuda.max_memory_allocated() - base,
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "limiter_stalls": model._unit_state.root.scheduler.limiter_stalls,
    }


@pytest.mark.parametrize(
    "backend, world_size, limit",
    [("nccl", 1, 2), ("gloo", 2, 1), ("gloo", 2, 2), ("gloo", 2, None)],
    ids=["nccl-W1", "gloo-W2-limit1", "gloo-W2-limit2", "gloo-W2-unbounded"],
)
def test_step_memory_within_bound(backend, world_size, limit):
    want = bound(world_size)
    for rank, got in enumerate(run_distributed(_measure, world_size, backend, limit, timeout=180)):
        print(f"rank {rank}: state {got['state'] / MIB:.2f} MiB (bound {want['state'] / MIB:.2f}), "
              f"peak {got['peak'] / MIB:.2f} MiB (bound {want['peak'] / MIB:.2f}), peak reserved "
              f"{got['peak_reserved'] / MIB:.1f} MiB, limiter stalls {got['limiter_stalls']}")
        assert got["state"] <= want["state"], f"rank {rank}: between steps {got} over {want}"
        assert got["state_after"] == got["state"], f"rank {rank}: what stays between steps grew: {got}"
        assert got["peak"] <= want["peak"], f"rank {rank}: step peak {got} over {want}"
        assert got["num_alloc_retries"] == 0, f"rank {rank}: the allocator retried: {got}"
