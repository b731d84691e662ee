"""The rank-divergence guard's cost per training step: flatshard with the guard on, off, and strict.

[Note: Guard cost]
One job per world size: three flatshard peers of the same workload are built (the guard's
mode is read when a root first runs, so each is built and run once under its own
FLATSHARD_RANK_GUARD), then timed interleaved as in benchmarks/run.py (fsbench.timing:
warm-up, rounds of blocks, each peer's block in turn, medians). Reported: each mode's
median step time and its ratio to the guard off; the guard's cost per step in
microseconds. See [Note: Rank-divergence guard] in python/flatshard/_rank_guard.py.

    python benchmarks/guard_cost.py [--world-size 2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from typing import Any  # noqa: E402

import torch.distributed as dist  # noqa: E402

from fsbench.dist_env import Ctx, launch  # noqa: E402
from fsbench.models import local_slice, make_batches  # noqa: E402
from fsbench.peers import build_peer  # noqa: E402
from fsbench.timing import Plan, Timed, interleaved, summarize  # noqa: E402
from fsbench.workloads import SPECS  # noqa: E402

MODES = {"off": "0", "on": "1", "strict": "strict"}
PLANS = {
    "gpt": Plan(warmup=2, rounds=10, steps_per_block=5, drop_per_block=1),
    "many-small-units": Plan(warmup=3, rounds=10, steps_per_block=6, drop_per_block=1),
}
BATCHES = {"gpt": 8, "many-small-units": 16}


def _measure(ctx: Ctx, arg: tuple[str, Plan]) -> dict:
    workload, plan = arg
    spec = SPECS[workload]()
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, 4, BATCHES[workload])]
    peers = {}
    for mode, value in MODES.items():
        os.environ["FLATSHARD_RANK_GUARD"] = value
        peer = build_peer("flatshard", spec, ctx)
        peer.step(*batches[0])  # the first forward makes the root (and its guard, if on)
        peers[mode] = peer
    os.environ.pop("FLATSHARD_RANK_GUARD")
    modes_seen = {m: ("_rank_guard" in p.model.__dict__) for m, p in peers.items()}
    inside = _time_inside_checks(peers["on"])
    items = {m: Timed(run=lambda i, p=p: p.step(*batches[i % len(batches)])) for m, p in peers.items()}
    samples, errors = interleaved(ctx, items, plan)
    out = {"workload": workload, "world_size": ctx.world_size, "guard_created": modes_seen, "errors": errors,
           "units": peers["on"].units}
    for mode in peers:
        if mode in samples and samples[mode]:
            out[mode] = summarize(samples[mode])
    # The guard's own time on the step's critical path: per check, the time the last rank to arrive spent inside it
    # (the smallest over the ranks: the exchanges' round trips once every rank is there; an earlier rank's longer wait
    # is skew that the step's first collective would absorb without the guard), summed per step. The steps' noise does
    # not blur it.
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, inside["durations"])
    n = min(len(d) for d in every)
    last_in = [min(d[i] for d in every) for i in range(n)]
    out["last_rank_in_checks_us_per_step"] = sum(last_in) / max(1, n // 2) * 1e6
    out["any_rank_in_checks_us_per_step"] = max(sum(d[:n]) for d in every) / max(1, n // 2) * 1e6
    return out


def _time_inside_checks(peer: Any) -> dict:
    """Records the seconds of each of the peer's root's guard checks from now on (a wrapper on the instance)."""
    import time

    guard = peer.model._unit_state.root.guard
    tally: dict = {"durations": []}
    check = guard.check

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            check(*args, **kwargs)
        finally:
            tally["durations"].append(time.perf_counter() - start)

    guard.check = timed
    return tally


def _exchange(ctx: Ctx, repeats: int) -> dict:
    """One check's exchange alone: back-to-back checks of a built root's guard (no compute between them, so no
    skew to absorb), median microseconds, and the rounds it takes ([Note: The guard's exchange in log W rounds])."""
    import time

    import torch.distributed as dist

    spec = SPECS["gpt"]()
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, 1, BATCHES["gpt"])]
    peer = build_peer("flatshard", spec, ctx)
    peer.step(*batches[0])
    root = peer.model._unit_state.root
    samples = []
    for i in range(repeats + 10):
        dist.barrier()
        start = time.perf_counter()
        root.guard.check(root, "state_dict()")
        if i >= 10:
            samples.append(time.perf_counter() - start)
    samples.sort()
    return {"world_size": ctx.world_size, "rounds": len(root.guard._rounds),
            "median_us": samples[len(samples) // 2] * 1e6}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workloads", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--exchange", action="store_true", help="time one check's exchange alone, and model W = 1024")
    p.add_argument("--out", default=os.path.join(HERE, "out", "guard_cost.json"))
    args = p.parse_args()
    plans = {w: (Plan(warmup=1, rounds=2, steps_per_block=3, drop_per_block=1) if args.quick else plan)
             for w, plan in PLANS.items() if w in args.workloads}
    if args.exchange:
        r = launch([("exchange", _exchange, 200)], args.world_size, "cpu")["exchange"]
        if "error" in r:
            print(f"failed: {r['error']}")
            return 1
        per_round = r["median_us"] / max(1, r["rounds"])
        print(f"W={args.world_size}: one check's exchange {r['median_us']:.0f} us in {r['rounds']} rounds "
              f"({per_round:.0f} us per round); modelled at W=1024: 10 rounds, {10 * per_round / 1e3:.2f} ms per check "
              f"(a ring all-gather: 1023 steps, {1023 * per_round / 1e3:.0f} ms)")
        return 0
    tasks = [(w, _measure, (w, plan)) for w, plan in plans.items()]
    results = launch(tasks, args.world_size, "cpu")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    print(f"guard cost, W={args.world_size}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"commit {commit}")
    print(f"{'workload':18} {'off ms':>8} {'on ms':>8} {'strict ms':>10} {'on/off':>7} {'strict/off':>10} "
          f"{'on - off per step':>18} {'last rank in checks':>20} {'any rank':>9}")
    for w, r in results.items():
        if "error" in r or "off" not in r:
            print(f"{w:18} failed: {r.get('error') or r.get('errors')}")
            continue
        off, on, strict = (r[m]["median_ms"] if m in r else float("nan") for m in ("off", "on", "strict"))
        last, anyone = (r.get(k, float("nan")) for k in ("last_rank_in_checks_us_per_step", "any_rank_in_checks_us_per_step"))
        print(f"{w:18} {off:8.2f} {on:8.2f} {strict:10.2f} {on / off:7.3f} {strict / off:10.3f} "
              f"{(on - off) * 1e3:15.0f} us {last:8.0f} us ({last / 1e3 / on:.2%}) {anyone:6.0f} us")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
