"""flatshard.plan's memory per rank against the measured peak (issue 20; not yet within its 5%).

For the tests' GPT (4 blocks of 128 wide, fp32, AdamW) at W = 1, 2, 4 over gloo on CPU and each of
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD: the measured peak of one step (what is held between steps, plus
the highest C-allocator count seen after any op during the step: tests/test_no_sync_memory.py's
tracker) against ``flatshard.plan(...).memory.device_peak``, whose activation term is measured from
a plain local forward and backward on the rank's batch (its peak less its gradients). Prints one line per case with
planned / measured. Run: python benchmarks/plan_memory.py
"""
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _dist import run_distributed  # noqa: E402
from models import GPT, Block, gpt_loss, local_slice, make_batch  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402
from test_no_sync_memory import _in_use, _PeakTracker  # noqa: E402

def gpt(device=None):
    with torch.device(device or "cpu"):
        torch.manual_seed(0)
        return GPT(64, 128, 4, 4, 8)

def step_fn(model, opt, batch):
    def step():
        gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step

def peak(step):
    step()
    gc.collect()
    with _PeakTracker() as t:
        step()
    return t.peak

def run(rank, ws, strategy):
    from torch.distributed.fsdp import ShardingStrategy

    import flatshard
    from flatshard import FullyShardedDataParallel as FSDP

    batch = local_slice(make_batch(batch=8, seq=8, vocab=64), rank, ws)
    # activations: a plain local forward and backward, less the gradients it made
    local = gpt()
    gpt_loss(local, *batch).backward()  # (a first step also allocates what torch keeps for later ones)
    local.zero_grad(set_to_none=True)
    gc.collect()
    with _PeakTracker() as tracker:
        gpt_loss(local, *batch).backward()
    act = max(0, tracker.peak - sum(p.numel() * p.element_size() for p in local.parameters()))
    del local
    gc.collect()
    start = _in_use()
    model = FSDP(gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy[strategy])
    opt = torch.optim.AdamW(model.parameters())
    step = step_fn(model, opt, batch)
    step()
    gc.collect()
    held = _in_use() - start
    with _PeakTracker() as t:
        step()
    measured = held + t.peak
    m = flatshard.plan(gpt("meta"), ws, auto_wrap_policy=ModuleWrapPolicy({Block}),
                       sharding_strategy=ShardingStrategy[strategy], activation_bytes=act,
                       optimizer_foreach=False, backend="gloo").memory  # (AdamW on CPU: a tensor at a time)
    return dict(measured=measured, planned=m.device_peak, activations=act, held_between_steps=held, plan=m.as_dict())

if __name__ == "__main__":
    for ws in (1, 2, 4):
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            r = run_distributed(run, ws, s, timeout=120)[0]
            print(f"W={ws} {s:<14} planned {r['planned']:>10} measured {r['measured']:>10} "
                  f"ratio {r['planned'] / r['measured']:.3f}", flush=True)
