"""The host cost of each crossing into the C++ runtime per training step, on ``many-small-units`` at W=1.

[Note: Crossings per step]
A unit's lifecycle crosses into C++ once per step of it (see [Note: One crossing per lifecycle step] in
csrc/bindings/bindings.cpp): ``wait_for_unshard`` at pre-forward and pre-backward, ``post_backward``, ``reshard``. At
W=1 no collective runs, so what these calls cost is the runtime's own host work (views, flattening and adding the
gradients, bookkeeping), the part of the per-unit overhead that lives in C++. This builds the workload's model with
``fully_shard`` and with the class, puts a timing proxy in front of each root's scheduler (its own cost, about half
a microsecond a call, is inside the figures), trains ``--steps`` steps and prints calls per step and microseconds per
call of each crossing, with the whole step's median beside them. For before/after comparisons of a change to the
runtime's hot path run it with each build in turn (``PYTHONPATH`` pointing at each); the step's median moves with
the machine's load, the per-call figures much less.

    python benchmarks/crossings.py [--steps 100]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fsbench.models import TinyLayer, TinyStack  # noqa: E402


class _TimedScheduler:
    """Forwards every attribute of the scheduler; calls are timed into ``totals`` by name."""

    def __init__(self, inner: Any, totals: dict[str, list]) -> None:
        self._inner = inner
        self._totals = totals

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        totals = self._totals

        def timed(*args: Any, _call: Callable = attr, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                entry = totals[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        return timed


def _build(api: str, mesh: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyStack(16, 64)
    if api == "fully_shard":
        from flatshard import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatshard import FullyShardedDataParallel

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TinyLayer}))


def _measure(api: str, steps: int, mesh: Any) -> tuple[float, dict[str, list]]:
    model = _build(api, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)

    def step() -> None:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):  # (lazy init, the optimizer's state, the learned orders)
        step()
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    root = next(m for m in model.modules() if hasattr(m, "_unit_state"))._unit_state.root
    root.scheduler = _TimedScheduler(root.scheduler, totals)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    root.scheduler = root.scheduler._inner
    return statistics.median(times), totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        for api in ("fully_shard", "class"):
            step, totals = _measure(api, args.steps, mesh)
            print(f"{api}: step {step * 1e3:.2f} ms (median of {args.steps}), crossings:")
            for name, (calls, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
                print(f"  {name:24s} {calls / args.steps:6.1f} a step  {seconds / calls * 1e6:6.2f} µs a call  "
                      f"{seconds / args.steps * 1e3:6.3f} ms a step")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
