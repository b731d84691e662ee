"""Interleaved timing: peers take turns in blocks, so slow drift hits all alike.

[Note: How a step is timed]
Every peer first runs ``warmup`` untimed steps. Then, for each of ``rounds``
rounds, every peer (in an order rotated by one each round) runs one block of
``steps_per_block`` steps: all ranks meet at a barrier before the block, each
rank times each step with ``time.perf_counter`` (after a device synchronize on
GPU), and a step's time is the maximum over ranks (one ``all_reduce(MAX)`` per
block). The first ``drop_per_block`` steps of each block are dropped too (the
caches were just used by another peer). What is left, ``rounds *
(steps_per_block - drop_per_block)`` steps per peer, is summarized by its
median and spread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from fsbench.dist_env import Ctx, error_text


@dataclass(frozen=True)
class Plan:
    warmup: int
    rounds: int
    steps_per_block: int
    drop_per_block: int

    @property
    def kept(self) -> int:
        return self.rounds * (self.steps_per_block - self.drop_per_block)


@dataclass
class Timed:
    """One thing to time: ``run(i)`` is timed; ``after(i)`` runs untimed right after it."""

    run: Callable[[int], None]
    after: Callable[[int], None] | None = None


def interleaved(ctx: Ctx, items: dict[str, Timed], plan: Plan) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Times ``items`` per [Note: How a step is timed]: (seconds per kept step, errors).

    An item that raises on any rank is dropped from later rounds and reported
    in ``errors`` (ranks agree through the block's all-reduce).
    """
    samples: dict[str, list[float]] = {name: [] for name in items}
    errors: dict[str, str] = {}
    counter = {name: 0 for name in items}

    def run_block(name: str, n: int, timed: bool) -> list[float] | None:
        item = items[name]
        times: list[float] = []
        failed = 0.0
        dist.barrier()
        try:
            for _ in range(n):
                i = counter[name]
                counter[name] += 1
                ctx.sync()
                t0 = time.perf_counter()
                item.run(i)
                ctx.sync()
                times.append(time.perf_counter() - t0)
                if item.after is not None:
                    item.after(i)
        except Exception as e:  # noqa: BLE001 - reported, the other peers go on
            errors[name] = error_text(e)
            failed = 1.0
            times += [0.0] * (n - len(times))
        # Max over ranks per step; the last slot says whether any rank failed.
        reduced = ctx.all_reduce(times + [failed], dist.ReduceOp.MAX)
        if reduced[-1] > 0:
            errors.setdefault(name, "failed on another rank")
            return None
        return reduced[:-1] if timed else []

    live = list(items)
    for name in list(live):
        if plan.warmup and run_block(name, plan.warmup, timed=False) is None:
            live.remove(name)
    names = list(live)
    for r in range(plan.rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            got = run_block(name, plan.steps_per_block, timed=True)
            if got is not None:
                samples[name].extend(got[plan.drop_per_block:])
    return {n: s for n, s in samples.items() if n not in errors}, errors


def summarize(seconds: list[float]) -> dict:
    """Median and spread of per-step times, in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) >= 2 else [ms[0]] * 3
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "q1_ms": q[0],
        "q3_ms": q[2],
        "iqr_ms": q[2] - q[0],
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
    }
