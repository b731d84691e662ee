"""flatshard.plan's step time against measured gloo steps on this machine (issue 20's timing model).

Per world size (W = 2, 4 by default), in one job:
1. the network: flatshard's own all-gather and reduction paths (the `collectives` benchmark's) at three
   unit sizes, fitted as a ring ([Note: The timing model]); then the latency a collective has inside a
   training step, where it waits for its peers and for the threads that share the cores with the compute:
   the `many-small-units` workload (65 units of 16x16, all latency) stepped wrapped and unwrapped, its
   excess over the ring's per-step latencies spread over its collectives;
2. the compute: the `gpt` workload's model unwrapped (the `local` peer), its forward, backward and
   optimizer step on the rank's batch timed with ``flatshard.plan.measure_compute``, all ranks at once
   (the same contention for the two cores as the wrapped steps);
3. flatshard's step (the `flatshard` peer: FULL_SHARD, one unit per block), interleaved with the local
   peer's in rounds (fsbench.timing), medians;
4. ``flatshard.plan`` of the same wrap on the meta device with that network and compute
   (``device="cpu"``: collectives after the compute, gloo's reduce-scatter an all-reduce):
   predicted against measured.

    python benchmarks/plan_timing.py [--world-sizes 2 4] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsbench.dist_env import Ctx, launch  # noqa: E402
from fsbench.models import local_slice, make_batches  # noqa: E402
from fsbench.peers import build_peer  # noqa: E402
from fsbench.timing import Plan, Timed, interleaved, summarize  # noqa: E402
from fsbench.workloads import SPECS  # noqa: E402

UNIT_MB = (0.02, 0.7, 4)  # a latency-bound size, the `gpt` workload's units (0.7 MB), a bandwidth-bound size


def _fit_gloo(ctx: Ctx, plan: Plan) -> dict:
    """The network a ring model needs to give flatshard's own collectives' times on this machine: the
    `collectives` benchmark's paths (unshard + wait; accumulate + reduce + finish, which gloo runs as an
    all-reduce) at three unit sizes, fitted by least squares to ``steps * step_latency + bytes sent / bandwidth``
    (see [Note: The timing model])."""
    from fsbench.workloads import _one_size

    w = ctx.world_size
    rows, points = [], []
    for mb in UNIT_MB:
        row = _one_size(ctx, mb, plan)
        rows.append(row)
        full = row["bytes"]
        gather = row["ops"]["flatshard all_gather"]["median_ms"] / 1e3
        reduce = row["ops"]["flatshard reduce_scatter"]["median_ms"] / 1e3
        points.append((w - 1, (w - 1) * full / w, gather))  # (steps, bytes sent, seconds)
        points.append((2 * (w - 1), 2 * (w - 1) * full / w, reduce))
    # least squares for t = steps * a + sent * b
    sxx = sum(s * s for s, _, _ in points)
    sxy = sum(s * b for s, b, _ in points)
    syy = sum(b * b for _, b, _ in points)
    sxt = sum(s * t for s, _, t in points)
    syt = sum(b * t for _, b, t in points)
    det = sxx * syy - sxy * sxy
    a = (sxt * syy - syt * sxy) / det
    b = (syt * sxx - sxt * sxy) / det
    if b <= 0:  # the sizes' times did not grow with the bytes (noise): bandwidth from the largest alone
        steps, sent, seconds = points[-2]
        b = max(seconds - steps * max(a, 0.0), 1e-9) / sent
    return {"bandwidth": 1 / b, "step_latency": max(0.0, a), "points": points}


def _step_latency(ctx: Ctx, plan: Plan, gloo: dict) -> dict:
    """The fixed latency of one collective inside a step (see the module's docstring, 1.)."""
    import flatshard
    from flatshard.plan import Network
    from flatshard.plan._timing import _guard_rounds
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    spec = SPECS["many-small-units"]()
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, 4, 16)]
    peers = {"flatshard": build_peer("flatshard", spec, ctx), "local": build_peer("local", spec, ctx)}
    items = {name: Timed(run=lambda i, p=p: p.step(*batches[i % len(batches)])) for name, p in peers.items()}
    samples, _ = interleaved(ctx, items, plan)
    excess = (summarize(samples["flatshard"])["median_ms"] - summarize(samples["local"])["median_ms"]) / 1e3
    with torch.device("meta"):
        meta = spec.build()
    ring = flatshard.plan(meta, ctx.world_size, auto_wrap_policy=ModuleWrapPolicy({spec.unit_cls}), backend="gloo",
                          device="cpu", network=Network("ring", gloo["bandwidth"], 0.0, gloo["step_latency"]),
                          compute=(0.0, 0.0, 0.0))
    calls = sum(bool(t.all_gather) * (1 + (u.reshard_after_forward and not u.is_root))
                + bool(t.reduce_scatter or t.all_reduce) + bool(t.replica_all_reduce)
                for u, t in zip(ring.units, ring.traffic)) + 2 * _guard_rounds(ctx.world_size)  # and the guard's rounds
    return {"latency": max(0.0, excess - ring.timing.communication) / calls, "excess_s": excess, "calls": calls}


def _measure(ctx: Ctx, plan: Plan) -> dict:
    import flatshard
    from flatshard.plan import Network, measure_compute
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    spec = SPECS["gpt"]()
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, 4, 8)]
    gloo = _fit_gloo(ctx, plan)
    gloo.update(_step_latency(ctx, plan, gloo))
    local = build_peer("local", spec, ctx)
    x, y = batches[0]
    compute = measure_compute(local.model, lambda m: spec.loss(m(x), y), local.optimizer, repeats=9)
    compute = tuple(v / ctx.world_size for v in ctx.all_reduce(list(compute)))  # the ranks' mean
    peers = {"flatshard": build_peer("flatshard", spec, ctx), "local": local}
    items = {name: Timed(run=lambda i, p=p: p.step(*batches[i % len(batches)])) for name, p in peers.items()}
    samples, errors = interleaved(ctx, items, plan)
    measured = {name: summarize(samples[name]) for name in peers if samples.get(name)}
    # gloo on this machine: a loopback network on the cores the ranks compute on; a core each up to the cores' count
    network = Network("gloo (fitted here)", gloo["bandwidth"], gloo["latency"], gloo["step_latency"],
                      transfer_on_compute_cores=ctx.world_size <= (os.cpu_count() or 1))
    with torch.device("meta"):
        meta = spec.build()
    planned = flatshard.plan(meta, ctx.world_size, auto_wrap_policy=ModuleWrapPolicy({spec.unit_cls}),
                             backend="gloo", device="cpu", network=network, compute=compute,
                             optimizer="adamw", optimizer_foreach=False).timing
    return {"world_size": ctx.world_size, "gloo": gloo, "compute_s": compute, "measured": measured,
            "errors": errors, "planned": planned.as_dict()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    plan = (Plan(warmup=1, rounds=2, steps_per_block=3, drop_per_block=1) if args.quick
            else Plan(warmup=2, rounds=8, steps_per_block=5, drop_per_block=1))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    print(f"plan timing, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}")
    for w in args.world_sizes:
        r = launch([("timing", _measure, plan)], w, "cpu")["timing"]
        if "error" in r:
            print(f"W={w}: failed: {r['error']}")
            continue
        t = r["planned"]
        fs = r["measured"]["flatshard"]["median_ms"] / 1e3
        local = r["measured"]["local"]["median_ms"] / 1e3
        print(f"W={w}: gloo fitted {r['gloo']['bandwidth'] / 1e9:.2f} GB/s, {r['gloo']['step_latency'] * 1e6:.0f} us "
              f"per ring step, {r['gloo']['latency'] * 1e6:.0f} us per collective in a step; compute fwd/bwd/opt {', '.join(f'{v * 1e3:.1f}' for v in r['compute_s'])} ms "
              f"(local step measured {local * 1e3:.1f} ms)")
        print(f"     planned step {t['step'] * 1e3:.1f} ms (collectives {t['communication'] * 1e3:.1f}: "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(t['per_kind'].items()))
              + f"), measured flatshard step {fs * 1e3:.1f} ms: planned / measured {t['step'] / fs:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
