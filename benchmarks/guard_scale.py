"""The rank guard's cost as the job grows: its connections, store operations and startup time at W ranks (issue 33).

[Note: The guard at scale]
Model (W ranks; m the largest power of two <= W; see [Note: The guard's exchange in log W rounds] in
python/flatshard/_rank_guard.py and [Note: A quiet heartbeat] in _stall_watch.py):
- connections per rank beyond its process groups': one TCP link per round, log2(m) (+1 when W is not a power of two:
  the extra pair): 6 / 10 / 13 at W = 64 / 1024 / 8192. The heartbeat waits on a UDP socket (no connection; see
  [Note: Waking a heartbeat without a connection] in python/flatshard/_wakeup.py). At W not a power of two no
  scheme does with floor(log2 W): at W = 3 that is one connection per rank, and three ranks joined by at most one
  connection each are not all connected;
- store operations at startup, per rank: per link about 6 (the listener's secret and address, the connector's reads,
  both ends' "ready") plus the polls of a partner not yet there; the stall watch's first record, beat and wake-up
  address (3). So about 6 log2(W) + 3 per rank: 39 / 63 / 81, and W times that on the store's server (2.5 k / 65 k /
  664 k), once;
- while healthy: no store operation at all, nothing sent or received by the heartbeat;
- per check (two a step: forward, backward): log2(m) (+2) rounds, each a 128-byte swap with one partner: 6 / 10 / 13
  round trips, 0.8 / 1.3 / 1.7 KB sent per rank;
- on a divergence only: the same rounds again with the distinct descriptions (a few KB); on a stall: the stalled rank
  reads the wake-up addresses of the ranks it looks at and sets their alarm keys once (log2 W of them; a roll call
  after a peer died: W - 1), sends each a datagram at every look, then every woken rank beats once a second while it
  lasts.
Before issue 33 the guard also made an eager gloo group over all ranks (W - 1 connections per rank: 8191 at W = 8192)
and every rank wrote to the store twice a second while healthy (16 k operations a second at W = 8192).

Measured here: ``python benchmarks/guard_scale.py --world-size 16`` starts W processes on this machine (gloo, a
FileStore counting its operations), each wraps a tiny model with flatshard's class, and reports, with the guard off
and on: the time from ``init_process_group`` to the end of the first step (the slowest rank's), the guard's links per
rank, each rank's established TCP connections (the difference between on and off is the guard's), the store clients
cloned, and the store operations of steps 3 to 8 (what a healthy job does).
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

from flatshard.testing._probes import counting_file_store, established_tcp_connections

HERE = os.path.dirname(os.path.abspath(__file__))


def _rank(rank: int, world_size: int, path: str, guard: str, out: dict) -> None:
    os.environ["FLATSHARD_RANK_GUARD"] = guard
    torch.set_num_threads(1)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatshard import FullyShardedDataParallel as FSDP

    start = time.perf_counter()
    store = counting_file_store(path, world_size)
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
                 "tcp_connections": established_tcp_connections(), "store_clones": store.clones,
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
            "tcp_connections_per_rank_max": max(r["tcp_connections"] for r in ranks),
            "store_clones_total": sum(r["store_clones"] for r in ranks),
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
