"""An interleaved A/B of the runner's peers, with variants built under environment settings.

    python benchmarks/peer_ab.py --workload many-small-units --world-size 2 \\
        --peers flatshard,flatshard-fs,flatshard-fs@FLATSHARD_GATHER_TOGETHER_BYTES=0,fsdp2

A peer is a name of ``fsbench.peers.build_peer`` (``flatshard``, ``flatshard-fs``, ``fsdp2``, ``fsdp1``, ``ddp``,
``local``), optionally ``@NAME=VALUE`` (several joined by ``@``): the variables are set while that peer is built (what
fully_shard reads at construction), then unset. Every peer runs the same batches, round after round (the first round
dropped), and the median step time and forward + backward time of each are printed, with the ratio to the last peer.
For quick comparisons of one setting; ``run.py`` is the benchmark of record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    from fsbench.dist_env import Ctx
    from fsbench.models import local_slice, make_batches
    from fsbench.peers import build_peer
    from fsbench.workloads import SPECS

    spec = SPECS[args.workload]()
    ctx = Ctx(rank, world_size, torch.device("cpu"), "gloo")
    names = args.peers.split(",")
    peers = {}
    for name in names:
        base, *settings = name.split("@")
        env = dict(s.split("=", 1) for s in settings)
        os.environ.update(env)
        try:
            peers[name] = build_peer(base, spec, ctx)
        finally:
            for key in env:
                os.environ.pop(key)
    batches = [local_slice(b, rank, world_size) for b in make_batches(spec, 4, args.global_batch)]
    steps = {n: [] for n in names}
    forward_backward = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            peer = peers[name]
            for i, (x, y) in enumerate(batches):
                dist.barrier()
                t0 = time.perf_counter()
                peer.forward_backward(x, y)
                t1 = time.perf_counter()
                peer.optimizer_step()
                if r > 0 and i > 0:  # warm-up round, and each round's first step
                    steps[name].append(time.perf_counter() - t0)
                    forward_backward[name].append(t1 - t0)
    if rank == 0:
        ref = statistics.median(steps[names[-1]])
        for name in names:
            step = statistics.median(steps[name])
            print(f"{name:50s} step {step * 1e3:9.2f} ms  {step / ref:6.3f}x {names[-1]}  "
                  f"forward + backward {statistics.median(forward_backward[name]) * 1e3:9.2f} ms")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="many-small-units")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--peers", default="flatshard,flatshard-fs,fsdp2")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args.world_size, 29000 + os.getpid() % 500, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
