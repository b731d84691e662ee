"""Overlap on a GPU, from a profiler trace: unit i+1's all-gather moves its bytes
on another stream while unit i computes on the compute stream.

Skipped without CUDA. World size 2 with both ranks on one GPU over gloo (NCCL
refuses two ranks on one device; at world size 1 no unit needs an all-gather).
gloo's all-gather of CUDA tensors is two copies on gloo's own CUDA streams (the
shard to pinned host memory, then every rank's chunk back into flatshard's
unsharded buffer) around an exchange on gloo's CPU thread; that device work is
what the trace shows and what must overlap compute. With NCCL the collective is
one kernel on NCCL's stream; the scheduler orders either through the same events.

[Note: Attributing device work in the trace]
- A unit's compute: the model's ``Heavy`` layers put their forward inside a
  ``record_function("test::compute i")`` range. The kernels of that forward are
  those whose launch (a ``cuda_runtime``/``cuda_driver`` event, linked by its
  ``correlation`` id) lies inside the range on the same thread. Their backward
  kernels are those launched inside autograd ops whose ``Sequence number`` is one
  of the forward ops' in that range.
- A unit's all-gather: each unit holds an ``extra`` parameter of a different
  size, so its shard and unsharded sizes in bytes are its own. The all-gather's
  copies are the ``gpu_memcpy`` events of exactly those sizes (gloo copies the
  output per rank chunk, each a shard). A unit's reduce-scatter copies have the
  same sizes but come only after the unit's own backward, so they cannot stand in
  for its all-gather during the compute of the unit before it.
The check: for every consecutive pair of layers, some copy of unit i+1's
all-gather runs on a stream other than the compute stream and overlaps, in
time, the span of unit i's compute kernels (forward with forward_prefetch, and
backward with BACKWARD_PRE, where the next unit is i-1).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.profiler import ProfilerActivity, profile, record_function

from flatshard.testing import run_distributed

pytestmark = pytest.mark.gpu

WORLD_SIZE = 2
N_LAYERS = 4
DIM = 2048  # a Linear of 16 MiB: its all-gather takes milliseconds through gloo
BATCH = 8192  # rows per rank
# Matmuls per layer forward: 1.1 TFLOP in fp32, >= 20 ms of compute per layer, against
# 5-15 ms for gloo's exchange of a 16 MiB unit (with 4096 rows and 8 matmuls, 6 ms of
# compute, the first layer's forward once ended before the next all-gather's copies).
REPS = 16
EXTRA = 1024  # layer i holds EXTRA * (i + 1) more elements


class Heavy(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(DIM, DIM)
        self.extra = nn.Parameter(torch.zeros(EXTRA * (index + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function(f"test::compute {self.index}"):
            for _ in range(REPS):
                x = torch.tanh(self.lin(x))
            return x + self.extra.sum()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.layers = nn.ModuleList(Heavy(i) for i in range(N_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _unit_bytes(index: int, world_size: int) -> tuple[int, int]:
    """(shard bytes, unsharded bytes) of layer ``index``'s flat parameter (fp32)."""
    numel = DIM * DIM + DIM + EXTRA * (index + 1)
    padded = -(-numel // world_size) * world_size
    return padded // world_size * 4, padded * 4


def _spans(events: list[dict], ranges: list[dict]) -> list[dict]:
    """Device events launched inside any of ``ranges`` (CPU events), through correlation ids."""
    by_tid: dict = {}
    for r in ranges:
        by_tid.setdefault(r["tid"], []).append((r["ts"], r["ts"] + r["dur"]))
    correlations = set()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["tid"] in by_tid:
            if any(a <= e["ts"] <= b for a, b in by_tid[e["tid"]]):
                correlations.add(e["args"]["correlation"])
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and e.get("args", {}).get("correlation") in correlations]


def _interval(device_events: list[dict]) -> tuple[float, float, set]:
    start = min(e["ts"] for e in device_events)
    end = max(e["ts"] + e["dur"] for e in device_events)
    return start, end, {e["args"]["stream"] for e in device_events}


def _analyze(trace_path: str, world_size: int) -> dict:
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    out: dict = {"forward": {}, "backward": {}}
    for i in range(N_LAYERS):
        ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == f"test::compute {i}"]
        assert ranges, f"no test::compute {i} range in the trace"
        fwd = [k for k in _spans(events, ranges) if k.get("cat") == "kernel"]
        seqs = {e["args"].get("Sequence number") for e in cpu_ops if e["tid"] == ranges[0]["tid"]
                and ranges[0]["ts"] <= e["ts"] <= ranges[0]["ts"] + ranges[0]["dur"]} - {None, -1}
        bwd_ops = [e for e in cpu_ops if e["tid"] != ranges[0]["tid"] and e["args"].get("Sequence number") in seqs]
        bwd = [k for k in _spans(events, bwd_ops) if k.get("cat") == "kernel"]
        shard, full = _unit_bytes(i, world_size)
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e["args"].get("bytes") in (shard, full)]
        out["forward"][i] = _interval(fwd) if fwd else None
        out["backward"][i] = _interval(bwd) if bwd else None
        out.setdefault("copies", {})[i] = [(e["ts"], e["ts"] + e["dur"], e["args"]["stream"], e["name"])
                                           for e in copies]
    return out


def _overlaps(compute, copies) -> list[str]:
    """Copies on another stream than ``compute``'s that overlap its span: their descriptions."""
    start, end, streams = compute
    return [f"{name} on stream {s} [{a:.0f}, {b:.0f}]" for a, b, s, name in copies
            if s not in streams and a < end and b > start]


def _profile_step(rank: int, world_size: int, trace_dir: str) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Stack()
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Heavy}), device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, DIM, device=device, generator=torch.Generator(device).manual_seed(rank))

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # the first records the forward order that prefetch follows
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(trace_dir, f"overlap_rank{rank}.json")
    prof.export_chrome_trace(path)
    return _analyze(path, world_size)


def test_next_all_gather_overlaps_current_compute():
    trace_dir = os.environ.get("FLATSHARD_TEST_ARTIFACTS") or tempfile.mkdtemp(prefix="flatshard-overlap-")
    os.makedirs(trace_dir, exist_ok=True)
    results = run_distributed(_profile_step, WORLD_SIZE, trace_dir, timeout=240)
    problems, seen = [], []
    for rank, got in enumerate(results):
        for phase, pairs in (("forward", [(i, i + 1) for i in range(N_LAYERS - 1)]),
                             ("backward", [(i, i - 1) for i in range(N_LAYERS - 1, 0, -1)])):
            for computing, gathered in pairs:
                compute = got[phase][computing]
                if compute is None:
                    problems.append(f"rank {rank}: no {phase} kernels found for layers.{computing}")
                    continue
                if not got["copies"][gathered]:
                    problems.append(f"rank {rank}: no copy of layers.{gathered}'s all-gather in the trace")
                    continue
                hits = _overlaps(compute, got["copies"][gathered])
                what = (f"rank {rank} {phase}: layers.{computing} computes on streams {sorted(compute[2])} "
                        f"[{compute[0]:.0f}, {compute[1]:.0f}]; layers.{gathered}'s all-gather copies: "
                        f"{got['copies'][gathered]}")
                (seen if hits else problems).append(what)
    print("\n".join(seen))
    assert not problems, "no overlap where expected (trace in " + trace_dir + "):\n" + "\n".join(problems)
