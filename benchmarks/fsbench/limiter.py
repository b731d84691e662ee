"""The all-gather rate limiter on a GPU: flatshard's step time and peak memory with
at most 1 or 2 all-gathers in flight, and with no limit.

Runs at world size 2 with both ranks on one GPU over gloo (``launch(..., one_gpu=True)``;
NCCL refuses two ranks on one device, and at world size 1 nothing is gathered).
gloo's all-gather of CUDA tensors goes through pinned host memory, so the step is
slower than NCCL's would be; the settings are compared with each other, in one job.
The model is a GPT of 110 M parameters (8 blocks of width 1024: 50 MB units),
FULL_SHARD with forward_prefetch=True and BACKWARD_PRE, AdamW.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsbench.dist_env import Ctx
from fsbench.models import gpt_spec, local_slice, make_batches
from fsbench.peers import LR, WEIGHT_DECAY


@dataclass(frozen=True)
class LimiterConfig:
    limits: tuple[int | None, ...] = (1, 2, None)  # None: limit_all_gathers=False
    warmup: int = 2
    steps: int = 8
    global_batch: int = 8  # sequences of 256 tokens


def run_limiter(ctx: Ctx, cfg: LimiterConfig) -> dict:
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatshard import FullyShardedDataParallel as FSDP

    warnings.filterwarnings("ignore", category=FutureWarning)
    spec = gpt_spec(vocab=8192, seq_len=256, dim=1024, n_layers=8, n_heads=16)
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, 2, cfg.global_batch)]
    rows = []
    for limit in cfg.limits:
        os.environ["FLATSHARD_ALL_GATHER_LIMIT"] = str(limit or 2)
        gc.collect()
        ctx.sync()
        base = torch.cuda.memory_allocated(ctx.device)
        model = FSDP(spec.build(), auto_wrap_policy=ModuleWrapPolicy({spec.unit_cls}), device_id=ctx.device,
                     limit_all_gathers=limit is not None, forward_prefetch=True,
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def step(i: int) -> None:
            spec.loss(model(batches[i % 2][0]), batches[i % 2][1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for i in range(cfg.warmup):
            step(i)
        ctx.sync()
        stalls_before = model._unit_state.root.scheduler.limiter_stalls
        torch.cuda.reset_peak_memory_stats(ctx.device)
        times = []
        for i in range(cfg.steps):
            dist.barrier()
            ctx.sync()
            t0 = time.perf_counter()
            step(i)
            ctx.sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(ctx.device) - base
        reserved = torch.cuda.max_memory_reserved(ctx.device)
        retries = torch.cuda.memory_stats(ctx.device).get("num_alloc_retries", 0)
        median_ms = statistics.median(times) * 1e3
        got = ctx.all_reduce([median_ms, peak, reserved, retries, model._unit_state.root.scheduler.limiter_stalls - stalls_before],
                             dist.ReduceOp.MAX)
        rows.append({"limit": limit, "median_ms": got[0], "peak_bytes": int(got[1]), "peak_reserved_bytes": int(got[2]),
                     "num_alloc_retries": int(got[3]), "limiter_stalls": int(got[4])})
        del model, opt
    return {"world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "global_batch": cfg.global_batch, "steps": cfg.steps, "rows": rows}
