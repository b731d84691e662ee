"""The timed workloads: ``gpt``, ``many-small-units`` (training) and ``collectives``.

Each function runs on every rank of one job (see ``dist_env.launch``) and
returns a JSON-able result from rank 0's point of view (times are already the
max over ranks).
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsbench import guard
from fsbench.dist_env import Ctx, error_text
from fsbench.models import Blob, ModelSpec, gpt_large_spec, gpt_spec, local_slice, make_batches, param_bytes, tiny_stack_spec
from fsbench.peers import LABELS, PEERS, build_peer
from fsbench.timing import Plan, Timed, interleaved, summarize

SPECS = {"gpt": gpt_spec, "many-small-units": tiny_stack_spec, "gpt-large": gpt_large_spec}


@dataclass(frozen=True)
class TrainConfig:
    workload: str  # a key of SPECS
    global_batch: int  # samples per step over all ranks (divides by W)
    plan: Plan
    n_batches: int = 4  # distinct batches, cycled
    tf32: bool = False  # float32 matrix products on TF32 tensor cores (CUDA), for every peer alike
    precision: str = "fp32"  # or "bf16": see [Note: bf16 peers] in peers.py


def run_training(ctx: Ctx, cfg: TrainConfig) -> dict:
    """Builds every peer, guards each (see [Note: The guard]), then times them interleaved.

    On CUDA also each peer's peak memory (see [Note: Peak memory of a timed peer]).
    """
    warnings.filterwarnings("ignore", category=FutureWarning)
    if ctx.is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    spec: ModelSpec = SPECS[cfg.workload]()
    batches = make_batches(spec, cfg.n_batches, cfg.global_batch)
    ref = guard.reference(spec, batches, ctx.device)  # also makes cuBLAS's workspace before any peer
    entries: dict[str, dict] = {}
    peers = {}

    for name in PEERS:
        entry = entries[name] = {"label": LABELS[name]}
        gc.collect()
        allocated_before = torch.cuda.memory_allocated(ctx.device) if ctx.is_cuda else 0
        peer, verdict = _build_and_guard(name, spec, ctx, ref, batches, entry, precision=cfg.precision)
        if verdict is None:
            continue
        if not verdict["passed"] and name == "fsdp2" and ctx.backend == "gloo" and ctx.world_size > 1:
            # See [Note: gloo AVG]: keep the verdict as it comes, retry with SUM + divide.
            entry["guard_as_built"] = verdict
            del peer
            peer, verdict = _build_and_guard(name, spec, ctx, ref, batches, entry, force_sum=True,
                                             precision=cfg.precision)
            if verdict is None:
                continue
        if name == "local" and ctx.world_size > 1:
            verdict = {"passed": True, "baseline": True,
                       "note": "per-rank baseline: trains its own slice, no communication"}
        entry["guard"] = verdict
        if ctx.is_cuda:
            ctx.sync()
            entry["state_bytes"] = torch.cuda.memory_allocated(ctx.device) - allocated_before
        if verdict["passed"]:
            peers[name] = peer
        else:
            entry.update(status="failed", error=verdict["error"])
            del peer
            gc.collect()

    local_batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size)) for b in batches]
    transient = dict.fromkeys(peers, 0)
    # [Note: The forward and backward alone]
    # A step is forward + backward + the optimizer's step; the optimizer is the same code for every peer that
    # steps the same kind of tensors (FSDP2 and fully_shard: DTensors; AdamW with foreach=True for all, as torch
    # picks on a GPU: see peers.py). On the CPU each step's forward + backward is also timed alone (this rank's host
    # time: the device is the host), so that the sharding's own overhead shows apart from it.
    forward_backward = {name: [] for name in peers}

    def step(name: str, i: int) -> None:
        # [Note: Peak memory of a timed peer]
        # Every peer is alive during the interleaved timing, so a peer's peak is its
        # own state (allocated by its build and guard steps: parameters or shards,
        # optimizer state, anything it keeps between steps) plus the most its steps
        # allocated on top of what was allocated when they began. Allocation is in
        # host order, so the counters are read without a synchronize.
        if ctx.is_cuda:
            start = torch.cuda.memory_allocated(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        if ctx.is_cuda:
            peers[name].step(*local_batches[i % len(local_batches)])
        else:
            t0 = time.perf_counter()
            peers[name].forward_backward(*local_batches[i % len(local_batches)])
            forward_backward[name].append(time.perf_counter() - t0)
            peers[name].optimizer_step()
        if ctx.is_cuda:
            transient[name] = max(transient[name], torch.cuda.max_memory_allocated(ctx.device) - start)

    items = {name: Timed(run=lambda i, n=name: step(n, i)) for name in peers}
    exchanges = _unit_exchanges(spec, ctx)
    if exchanges is not None:
        items[_EXCHANGES] = Timed(run=lambda i: exchanges())
    samples, errors = interleaved(ctx, items, cfg.plan)
    floor = None
    if exchanges is not None and _EXCHANGES not in errors:
        floor = statistics.median(samples.pop(_EXCHANGES)) * 1e6 / spec.n_units
    tokens = cfg.global_batch * spec.tokens_per_sample
    for name in peers:
        entry = entries[name]
        if name in errors:
            entry.update(status="error", error=errors[name])
            continue
        stats = summarize(samples[name])
        entry.update(status="ok", time=stats, samples_ms=[s * 1e3 for s in samples[name]],
                     tokens_per_s=tokens / (stats["median_ms"] / 1e3))
        if forward_backward[name]:  # (see [Note: The forward and backward alone]; warm-up steps left out)
            entry["forward_backward_ms"] = statistics.median(forward_backward[name][cfg.plan.warmup:]) * 1e3
        if ctx.is_cuda:
            entry["peak_bytes"] = entry["state_bytes"] + transient[name]
    local = entries.get("local", {}).get("time")
    local_fb = entries.get("local", {}).get("forward_backward_ms")
    for entry in entries.values():
        if "time" in entry and local is not None:
            entry["overhead_us_per_unit"] = (entry["time"]["median_ms"] - local["median_ms"]) * 1e3 / spec.n_units
        if "forward_backward_ms" in entry and local_fb is not None:
            entry["forward_backward_overhead_us_per_unit"] = (entry["forward_backward_ms"] - local_fb) * 1e3 / spec.n_units
    model = spec.build()
    return {
        "workload": cfg.workload,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "global_batch": cfg.global_batch,
        "tokens_per_step": tokens,
        "units": spec.n_units,
        "param_bytes": param_bytes(model),
        "plan": vars(cfg.plan),
        "tf32": cfg.tf32 and ctx.is_cuda,
        "precision": cfg.precision,
        "guard_tolerance": guard.tolerance(cfg.precision),
        "reference": ref,
        "peers": entries,
        **({"exchange_floor_us_per_unit": floor} if floor is not None else {}),
    }


# [Note: The collectives' floor per unit]
# With units as small as ``many-small-units``' (272 parameters), a sharded step over gloo at W > 1 is mostly waiting:
# each unit's parameters are all-gathered in forward and again in backward, and its gradient reduce-scattered, and
# every one of those exchanges costs gloo's latency between the ranks' processes (hundreds of microseconds here),
# whoever issues it. So a peer that issues them one unit at a time holds that floor, and only one that issues fewer
# collectives goes under it: flatshard's fully_shard, which gathers and reduces small units together ([Note: Small
# units gathered together] in csrc/flatshard/scheduler.h). The run times it as one more item of the interleaved
# rounds: the same three collectives per unit on a unit's bytes (the model's parameters over its units, this rank's
# part), issued back to back with preallocated buffers, nothing else; a peer's overhead above it is what its own code
# costs (and what it fails to overlap).
_EXCHANGES = "exchanges"


def _unit_exchanges(spec: ModelSpec, ctx: Ctx):
    """The floor item's step (see [Note: The collectives' floor per unit]), or None where it does not apply."""
    if ctx.world_size == 1 or spec.name != "many-small-units":
        return None
    per_unit = -(-sum(p.numel() for p in spec.build().parameters()) // spec.n_units)
    shard = torch.zeros(-(-per_unit // ctx.world_size), device=ctx.device)
    full = torch.zeros(shard.numel() * ctx.world_size, device=ctx.device)
    reduced = torch.empty_like(shard)

    def run() -> None:
        for _ in range(spec.n_units):
            dist.all_gather_into_tensor(full, shard)  # forward
            dist.all_gather_into_tensor(full, shard)  # backward, resharded after forward
            dist.reduce_scatter_tensor(reduced, full)
        ctx.sync()

    return run


def _build_and_guard(name: str, spec: ModelSpec, ctx: Ctx, ref: dict, batches: list, entry: dict,
                     **kwargs) -> tuple:
    """(peer, guard verdict), or (None, None) with the build error in ``entry`` (collective)."""
    error = None
    try:
        peer = build_peer(name, spec, ctx, **kwargs)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a result
        error = error_text(e)
    if not ctx.agree(error is None):
        entry.update(status="error", error=error or "failed on another rank")
        return None, None
    entry.update(units=peer.units, notes=peer.notes)
    # Its steps are also the first warm-up.
    return peer, guard.check(peer, ref, batches, ctx, **guard.tolerance(kwargs.get("precision", "fp32")))


# ------------------------------------------------------------------ collectives
@dataclass(frozen=True)
class CollectivesConfig:
    sizes_mb: tuple[float, ...]
    plan: Plan


def run_collectives(ctx: Ctx, cfg: CollectivesConfig) -> dict:
    """flatshard's unshard / reduce path against the raw collectives, on the same bytes.

    Per size: a one-unit flatshard model of that many fp32 bytes. Timed, interleaved:
    ``unshard + wait_for_unshard`` (the reshard runs untimed after it) against
    ``all_gather_into_tensor`` into a preallocated output; and ``accumulate_grad +
    reduce_grad + finish_grad_sync`` against ``reduce_scatter_tensor(SUM)`` into a
    preallocated output. flatshard's numbers include what its path does beyond
    the bare collective (allocating the unsharded buffer; copying the gradient
    into the flat gradient, allocating and dividing the shard).
    """
    if ctx.world_size < 2:
        return {"skipped": f"needs world size >= 2 (an all-gather over {ctx.world_size} rank moves nothing)"}
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for mb in cfg.sizes_mb:
        rows.append(_one_size(ctx, mb, cfg.plan))
        gc.collect()  # the previous size's buffers go before the next size's arrive
    return {"world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "plan": vars(cfg.plan), "sizes": rows}


def _one_size(ctx: Ctx, mb: float, plan: Plan) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    w = ctx.world_size
    numel = int(mb * 2**20) // 4
    numel -= numel % w
    shard = numel // w
    row: dict = {"size_mb": mb, "bytes": numel * 4}
    error = None
    try:
        full = torch.randn(numel, generator=torch.Generator().manual_seed(7)).to(ctx.device)
        blob = Blob(numel)
        with torch.no_grad():
            blob.weight.copy_(full)
        model = FSDP(blob, device_id=ctx.device)  # one unit: the root
        with torch.no_grad():
            model(torch.ones(1, device=ctx.device))  # lazy init: creates the scheduler
        sched, handle = model._unit_state.root.scheduler, model._unit_state.handle
        ag_in = full[ctx.rank * shard : (ctx.rank + 1) * shard].clone()
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(100 + ctx.rank)).to(ctx.device)
    except Exception as e:  # noqa: BLE001 - reported in the row
        error = error_text(e)
    if not ctx.agree(error is None):
        row["error"] = error or "failed on another rank"
        return row
    try:
        correct = _check_paths(ctx, model, full, grad)
    except Exception as e:  # noqa: BLE001 - the raw collectives are still timed
        correct, row["check_error"] = False, error_text(e)
    row["correct"] = ctx.agree(correct)
    del full
    ag_out = torch.empty(numel, device=ctx.device)
    rs_out = torch.empty(shard, device=ctx.device)

    def fs_all_gather(_i: int) -> None:
        sched.unshard(handle)
        sched.wait_for_unshard(handle)

    def fs_reduce_scatter(_i: int) -> None:
        handle.accumulate_grad([grad])
        sched.reduce_grad(handle)  # the unit's own divide factors: the average over W
        sched.finish_grad_sync()

    def drop_grad(_i: int) -> None:
        model._flat_param.grad = None

    items = {
        "flatshard all_gather": Timed(fs_all_gather, after=lambda _i: sched.reshard(handle)),
        "raw all_gather_into_tensor": Timed(lambda _i: dist.all_gather_into_tensor(ag_out, ag_in)),
        "flatshard reduce_scatter": Timed(fs_reduce_scatter, after=drop_grad),
        "raw reduce_scatter_tensor": Timed(lambda _i: dist.reduce_scatter_tensor(rs_out, grad, op=dist.ReduceOp.SUM)),
    }
    if not row["correct"]:  # a wrong path is reported, not timed
        row["error"] = "flatshard's gather or reduction did not match the raw collective"
        items = {op: t for op, t in items.items() if op.startswith("raw")}
    samples, errors = interleaved(ctx, items, plan)
    row["ops"] = {}
    for op in items:
        if op in errors:
            row["ops"][op] = {"error": errors[op]}
        else:
            stats = summarize(samples[op])
            stats["gb_per_s"] = numel * 4 / (stats["median_ms"] / 1e3) / 1e9
            row["ops"][op] = stats
    return row


def _check_paths(ctx: Ctx, model, full: torch.Tensor, grad: torch.Tensor) -> bool:
    """flatshard's gather gives the full parameter, its reduction the raw SUM / W (collective)."""
    sched, handle, w = model._unit_state.root.scheduler, model._unit_state.handle, ctx.world_size
    sched.unshard(handle)
    sched.wait_for_unshard(handle)
    gathered = bool(torch.equal(handle.unsharded[: full.numel()], full))
    sched.reshard(handle)
    handle.accumulate_grad([grad])
    sched.reduce_grad(handle)  # the unit's own divide factors: the average over W
    sched.finish_grad_sync()
    expected = torch.empty(full.numel() // w, device=full.device)
    dist.reduce_scatter_tensor(expected, grad.clone(), op=dist.ReduceOp.SUM)
    reduced = bool(torch.allclose(model._flat_param.grad, expected / w, rtol=1e-6, atol=1e-7))
    model._flat_param.grad = None
    return gathered and reduced
