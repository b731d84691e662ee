"""``--profile``: a Chrome trace of one flatshard training step of the ``gpt`` workload.

Open the files in https://ui.perfetto.dev or chrome://tracing. flatshard puts
every collective and wait in a ``flatshard::<what> <unit>`` range
(``flatshard::all_gather blocks.3``, ``flatshard::reduce_scatter blocks.3``,
``flatshard::wait_for_unshard blocks.3``, ...), so order and overlap show.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile, record_function

from fsbench.dist_env import Ctx
from fsbench.models import local_slice, make_batches
from fsbench.peers import build_peer
from fsbench.workloads import SPECS

WARMUP_STEPS = 3


@dataclass(frozen=True)
class TraceConfig:
    out_dir: str
    global_batch: int


def run_trace(ctx: Ctx, cfg: TraceConfig) -> dict:
    """Writes ``flatshard_gpt_w{W}_rank{r}.json`` per rank; returns the paths and range counts."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    spec = SPECS["gpt"]()
    batches = [tuple(t.to(ctx.device) for t in local_slice(b, ctx.rank, ctx.world_size))
               for b in make_batches(spec, WARMUP_STEPS + 1, cfg.global_batch)]
    peer = build_peer("flatshard", spec, ctx)
    for x, y in batches[:WARMUP_STEPS]:
        peer.step(x, y)
    ctx.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.is_cuda else [])
    with profile(activities=activities) as prof:
        with record_function("fsbench::train_step"):
            peer.step(*batches[-1])
            ctx.sync()
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, f"flatshard_gpt_w{ctx.world_size}_rank{ctx.rank}.json")
    prof.export_chrome_trace(path)
    ranges = Counter(e.name.split(" ")[0] for e in prof.events() if e.name.startswith("flatshard::"))
    return {"world_size": ctx.world_size, "trace_rank0": path, "flatshard_ranges": dict(sorted(ranges.items()))}
