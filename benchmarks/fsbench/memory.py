"""Memory per rank: the same measurement for every peer.

[Note: How memory is measured]
torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) was tried and
not used: it measures FSDP2 and FSDP1 on CPU, but raises ``RecursionError`` on
flatshard (its module tracker walks ``named_children``, and each flatshard unit
held the root as a ``_root`` child after the first forward then; units no longer do,
not tried again), and it would miss
flatshard's unsharded buffers anyway: it sees tensors through a
``TorchDispatchMode`` and storage resizes through the Python
``UntypedStorage.resize_``, while flatshard allocates and resizes them in C++.
Instead every peer is measured at the allocator:

- CPU: torch's profiler with ``profile_memory=True`` records every allocation and
  free of c10's CPU allocator (C++ allocations and storage resizes included),
  but only on the profiled thread, and a tensor is often freed on a gloo worker
  thread (the last reference to a collective's input dies with its work
  object). So the allocator's process-wide count is switched on too (the c10
  flag ``caffe2_report_cpu_memory_usage``, set through ``ctypes`` in memory jobs
  only: it costs ~1.5 us per allocation); each event then carries the live bytes
  of the whole process, all threads included. Recording starts *before* the
  model is built and live bytes are taken relative to that moment, so every
  byte the peer holds is seen being allocated. ``state`` is the live bytes when
  a measured step starts (what stays between steps: parameter shards, optimizer
  state and any buffers the wrapper keeps); ``peak`` is the maximum during the
  measured steps (state + unsharded parameters and gradients + activations and
  temporaries), sampled at every allocation or free of the training thread.
  Without the flag (another libc10 build) the events' running sum is used and
  the result says so.
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at
  the first measured step, relative to ``memory_allocated`` before the build;
  the profiler's events give the timeline.

One warm-up step creates the optimizer state; then ``steps`` steps are
measured. The batch is one short sequence per rank so that activations stay
small next to model state; the local run's activations (its peak minus its
parameters, gradients and AdamW state) are reported beside the bound. flatshard's own counter
(``_C.peak_unsharded_bytes``) is read over the same steps as a cross-check.
"""

from __future__ import annotations

import ctypes
import gc
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from fsbench.dist_env import Ctx, error_text
from fsbench.models import gpt_spec, local_slice, make_batches, param_bytes, unit_param_bytes
from fsbench.peers import LABELS, PEERS, build_peer

STEP_RANGE = "fsbench::measured_step"
TIMELINE_POINTS = 1500  # per peer, after downsampling


@dataclass(frozen=True)
class MemoryConfig:
    steps: int = 2
    seq_len: int = 16  # tokens per sequence; one sequence per rank
    timeline_peers: tuple[str, ...] = ("flatshard", "fsdp2")
    precision: str = "fp32"  # or "bf16": see [Note: bf16 peers] in peers.py


def run_memory(ctx: Ctx, cfg: MemoryConfig) -> dict:
    """Every peer's state and peak bytes per rank (max over ranks) at this world size."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    process_wide = ctx.is_cuda or _count_all_threads()
    spec = gpt_spec(batch_seq_len=cfg.seq_len)
    batches = make_batches(spec, cfg.steps + 1, ctx.world_size)  # one sequence per rank
    local = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size)) for b in batches]
    if ctx.is_cuda:
        # cuBLAS's and cuBLASLt's workspaces belong to the process, made by the first
        # matrix product of each kind (Lt: a Linear with bias): make them now, or the
        # first peer measured is charged for them.
        w = torch.randn(64, 64, device=ctx.device, requires_grad=True)
        b = torch.zeros(64, device=ctx.device, requires_grad=True)
        (torch.nn.functional.linear(w, w, b).sum() + (w @ w).sum()).backward()
        del w, b
        ctx.sync()
    peers: dict[str, dict] = {}
    for name in PEERS:
        entry = peers[name] = {"label": LABELS[name]}
        gc.collect()
        dist.barrier()
        error, got = None, None
        try:
            got = _measure(name, spec, ctx, local, cfg, process_wide)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a result
            error = error_text(e)
        if not ctx.agree(error is None):
            entry.update(status="error", error=error or "failed on another rank")
            continue
        keys = ("state_bytes", "peak_bytes", "flatshard_peak_unsharded_bytes")
        maxima = ctx.all_reduce([float(got[k]) for k in keys], dist.ReduceOp.MAX)
        entry.update(status="ok", **{k: int(v) for k, v in zip(keys, maxima)})
        if name in cfg.timeline_peers and ctx.rank == 0:
            entry["timeline_rank0"] = got["timeline"]
        gc.collect()

    model = spec.build()
    root, blocks = unit_param_bytes(spec)
    return {
        "world_size": ctx.world_size,
        "device": ctx.device.type,
        "batch": {"sequences_per_rank": 1, "seq_len": cfg.seq_len},
        "precision": cfg.precision,
        "param_bytes": param_bytes(model),
        "root_unit_param_bytes": root,
        "block_unit_param_bytes": max(blocks),
        "measured_steps": cfg.steps,
        "method": ("torch.cuda.max_memory_allocated" if ctx.is_cuda else
                   "CPU allocator, process-wide live bytes (all threads)" if process_wide else
                   "CPU allocator events of the training thread only (frees on other threads missed)"),
        "peers": peers,
    }


def bound_bytes(param: int, root: int, block: int, world_size: int) -> dict:
    """The analytic bound per rank: (params + grads + AdamW's two moments) / W + in-flight units.

    In flight (W > 1): the root unit (kept unsharded from forward into backward)
    and two blocks (the one computing and the one prefetched) as unsharded
    parameters, plus one block's unsharded gradient. At W = 1 nothing needs
    gathering: the shard is the whole parameter.
    """
    state = 4 * param / world_size
    in_flight = float(root + 3 * block) if world_size > 1 else 0.0
    return {"state": state, "in_flight": in_flight, "total": state + in_flight}


def _count_all_threads() -> bool:
    """Makes c10's CPU allocator count live bytes on every thread (see [Note: How memory is measured])."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError):
        return False
    return True


def _measure(name: str, spec, ctx: Ctx, batches: list, cfg: MemoryConfig, process_wide: bool) -> dict:
    from flatshard import _C

    cuda = ctx.is_cuda
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, profile_memory=True) as prof:
        peer = build_peer(name, spec, ctx, precision=cfg.precision)  # as built (the reduce op does not change memory)
        peer.step(*batches[0])  # warm-up: creates the optimizer state
        ctx.sync()
        if cuda:
            state_cuda = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
        _C.reset_peak_unsharded_bytes()
        for i in range(cfg.steps):
            with record_function(STEP_RANGE):
                peer.step(*batches[1 + i])
                ctx.sync()
        counter = _C.peak_unsharded_bytes()
        if cuda:
            peak_cuda = torch.cuda.max_memory_allocated() - base
        del peer
        gc.collect()
    got = _from_events(prof, ctx.device, process_wide)
    got["flatshard_peak_unsharded_bytes"] = counter
    if cuda:
        got["profiler_state_bytes"], got["profiler_peak_bytes"] = got["state_bytes"], got["peak_bytes"]
        got["state_bytes"], got["peak_bytes"] = state_cuda, peak_cuda
    return got


def _from_events(prof: profile, device: torch.device, process_wide: bool) -> dict:
    """Live bytes over time from the allocation events; state and peak over the measured steps.

    ``process_wide``: each event's ``total_allocated`` counts every thread's live
    bytes; otherwise the running sum of the events' sizes is used.
    """
    allocs: list[tuple[int, int, int]] = []
    steps: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == torch._C._profiler._EventType.Allocation:
            f = node.extra_fields
            if f.device.type == device.type:
                allocs.append((node.start_time_ns, f.alloc_size, f.total_allocated))
        elif node.name == STEP_RANGE:
            steps.append((node.start_time_ns, node.end_time_ns))
    if not steps:
        raise RuntimeError(f"memory: the profiler recorded no '{STEP_RANGE}' range")
    allocs.sort()
    steps.sort()
    t0, t_end = steps[0][0], steps[-1][1]
    base = allocs[0][2] - allocs[0][1] if allocs else 0  # the process's live bytes before the build
    live, state, peak = 0, None, 0
    timeline: list[tuple[float, int]] = []
    for t, size, total in allocs:
        if t >= t0 and state is None:
            state = live
            timeline.append((0.0, live))
        live = total - base if process_wide else live + size
        if t0 <= t <= t_end:
            peak = max(peak, live)
            timeline.append(((t - t0) / 1e6, live))
    if state is None:
        state = live
    peak = max(peak, state)
    timeline = _downsample(timeline)
    return {
        "state_bytes": state,
        "peak_bytes": peak,
        "timeline": {
            "ms": [round(p[0], 4) for p in timeline],
            "bytes": [p[1] for p in timeline],
            "step_starts_ms": [(s - t0) / 1e6 for s, _ in steps],
            "step_ends_ms": [(e - t0) / 1e6 for _, e in steps],
        },
    }


def _downsample(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """At most TIMELINE_POINTS points, keeping each bucket's maximum (peaks survive)."""
    if len(points) <= TIMELINE_POINTS:
        return points
    per = -(-len(points) // TIMELINE_POINTS)
    return [max(points[i : i + per], key=lambda p: p[1]) for i in range(0, len(points), per)]

