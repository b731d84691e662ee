"""The rank guard's cost as the job grows: its connections, store operations and startup time at W ranks (issue 33).

[Note: The guard at scale]
Model (W ranks; m the largest power of two <= W; see [Note: The guard's exchange in log W rounds] in
python/flatshard/_rank_guard.py and [Note: A quiet heartbeat] in _stall_watch.py):
- connections per rank beyond its process groups': one TCP link per round, log2(m) (+1 when W is not a power of two:
  the extra pair), and one cloned store client for the heartbeat's wait: 7 / 11 / 14 at W = 64 / 1024 / 8192;
- store operations at startup, per rank: per link about 6 (the listener's secret and address, the connector's reads,
  both ends' "ready") plus the polls of a partner not yet there; the stall watch's first record and beat (2). So
  about 6 log2(W) + 2 per rank: 38 / 62 / 80, and W times that on the store's server (2.4 k / 63 k / 655 k), once;
- while healthy: no store operation at all (one pending wait per rank, renewed every 5 minutes);
- per check (two a step: forward, backward): log2(m) (+2) rounds, each a 128-byte swap with one partner: 6 / 10 / 13
  round trips, 0.8 / 1.3 / 1.7 KB sent per rank;
- on a divergence only: the same rounds again with the distinct descriptions (a few KB); on a stall: the stalled rank
  sets W - 1 alarm keys once, then every rank beats once a second while it lasts.
Before issue 33 the guard also made an eager gloo group over all ranks (W - 1 connections per rank: 8191 at W = 8192)
and every rank wrote to the store twice a second while healthy (16 k operations a second at W = 8192).

Measured here: ``python benchmarks/guard_scale.py --world-size 16`` starts W processes on this machine (gloo, a
FileStore counting its operations), each wraps a tiny model with flatshard's class, and reports, with the guard off
and on: the time from ``init_process_group`` to the end of the first step (the slowest rank's), the guard's links per
rank, and the store operations of steps 3 to 8 (what a healthy job does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _counting_store(path: str, world_size: int):
    class CountingStore(dist.Store):
        """A FileStore counting the operations made on it (the heartbeat's cloned client is its own, uncounted)."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = dist.FileStore(path, world_size)
            self.operations = 0

        def _count(self, name, *args):
            self.operations += 1
            return getattr(self.inner, name)(*args)

        def set(self, key, value):
            return self._count("set", key, value)

        def get(self, key):
            return self._count("get", key)

        def add(self, key, amount):
            return self._count("add", key, amount)

        def check(self, keys):
            return self._count("check", keys)

        def compare_set(self, key, expected, desired):
            return self._count("compare_set", key, expected, desired)

        def delete_key(self, key):
            return self._count("delete_key", key)

        def num_keys(self):
            return self._count("num_keys")

        def multi_get(self, keys):
            return self._count("multi_get", keys)

        def multi_set(self, keys, values):
            return self._count("multi_set", keys, values)

        def wait(self, keys, timeout=None):
            return self._count("wait", keys) if timeout is None else self._count("wait", keys, timeout)

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

        def clone(self):
            return self.inner.clone()

    return CountingStore()


def _rank(rank: int, world_size: int, path: str, guard: str, out: dict) -> None:
    os.environ["FLATSHARD_RANK_GUARD"] = guard
    torch.set_num_threads(1)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatshard import FullyShardedDataParallel as FSDP

    start = time.perf_counter()
    store = _counting_store(path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    model = FSDP(torch.nn.Sequential(*layers), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i * world_size + rank))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    first = time.perf_counter() - start
    step(1)
    dist.barrier()
    before = store.operations
    steps = []
    for i in range(2, 8):
        t0 = time.perf_counter()
        step(i)
        steps.append(time.perf_counter() - t0)
    healthy = store.operations - before
    guard_state = model._unit_state.root.guard
    out[rank] = {"first_step_s": first, "links": len(guard_state._rounds) if guard_state else 0,
                 "healthy_store_ops": healthy, "step_ms": statistics.median(steps) * 1e3}
    dist.barrier()
    dist.destroy_process_group()


def _job(world_size: int, guard: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(world_size, os.path.join(tmp, "store"), guard, out), nprocs=world_size,
                           start_method="spawn")
        ranks = [out[r] for r in range(world_size)]
    return {"guard": guard, "world_size": world_size,
            "first_step_s_max": max(r["first_step_s"] for r in ranks),
            "links_per_rank_max": max(r["links"] for r in ranks),
            "healthy_store_ops_total": sum(r["healthy_store_ops"] for r in ranks),
            "step_ms_median": statistics.median(r["step_ms"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=16)
    args = parser.parse_args()
    results = [_job(args.world_size, guard) for guard in ("0", "1", "0", "1")]  # interleaved, twice
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
