"""flatshard.plan's memory per rank against the measured peak (tests/test_plan_memory.py, benchmarks).

Run with tests/memcount's malloc counter preloaded (``LD_PRELOAD``, see tests/_memcount.py): it
counts every byte any thread holds from the C allocator and keeps the true peak. For the
tests' GPT (4 blocks of 128 wide, fp32 AdamW unless the case says otherwise) and each case
(strategy x variant: plain, ``no_sync`` (one micro-batch inside it, one outside), bf16 mixed
precision, CPU offload), one rank:
- measures the activation term as a user would (``flatshard.plan.profile_activations``: a
  plain local forward and backward of the rank's batch, in the compute dtype, with where each
  unit's backward frees it), once per batch and dtype;
- wraps the model, runs a first step (lazy init; the optimizer makes its state), then measures
  the peak of the next three steps above what was held before the model was built;
- plans the same wrap on the meta device: ``combined_peak`` (one memory holding device and host:
  a CPU run) against the measured peak.
``python plan_memory_cases.py gloo 1 2 4`` runs W = 1, 2, 4 over gloo (every rank's line);
``python plan_memory_cases.py fake 1 8 1024`` runs one process as rank 3 (rank 0 at W = 1) of W-rank jobs
under torch's fake process group. One JSON line per case and rank.
"""

import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _memcount import MallocCounter  # noqa: E402
from models import GPT, Block, gpt_loss, local_slice, make_batch  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
VARIANTS = ("plain", "no_sync", "bf16", "offload")
GLOBAL_BATCH = 8
# The peak of a step depends on how the ranks' collectives happen to overlap their compute (gloo's all-gather
# holds a copy of its output while it runs): the highest of three steps is the one the plan's worst case meets.
# Under the fake group (no threads, nothing overlaps) every step after the first peaks alike: one is measured.
MEASURED_STEPS = {"gloo": 3, "fake": 1}


def _gpt(device=None):
    with torch.device(device or "cpu"):
        torch.manual_seed(0)
        return GPT(64, 128, 4, 4, 8)


def _batches(rank, world_size, simulated):
    """Two micro-batches of this rank's rows (a simulated rank takes a whole small batch)."""
    out = []
    for seed in (1, 2):
        batch = make_batch(batch=GLOBAL_BATCH, seq=8, vocab=64, seed=seed)
        out.append(batch if simulated else local_slice(batch, rank, world_size))
    return out


_PROFILES = {}


def _activations(rank, world_size, batch, dtype):
    """``flatshard.plan.profile_activations`` of a plain local step on ``batch``, as a user measures it once for
    a model, batch and dtype: the same for every strategy and variant, so profiled once per process for each."""
    import flatshard

    key = (rank, world_size, dtype)
    if key not in _PROFILES:
        _PROFILES[key] = flatshard.plan.profile_activations(_gpt(), lambda model: gpt_loss(model, *batch), dtype=dtype)
    return _PROFILES[key]


def measure_case(rank, world_size, strategy_name, variant, simulated=False):
    import flatshard
    from flatshard import CPUOffload, MixedPrecision, ShardingStrategy
    from flatshard import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    counter = MallocCounter()
    strategy = ShardingStrategy[strategy_name]
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if variant == "bf16" else None
    offload = CPUOffload(offload_params=True) if variant == "offload" else None
    batches = _batches(rank, world_size, simulated)
    activations = _activations(rank, None if simulated else world_size, batches[0],
                               torch.bfloat16 if mixed else None)

    def step(model, opt):
        if variant == "no_sync":
            with model.no_sync():
                gpt_loss(model, *batches[0]).backward()
        gpt_loss(model, *batches[-1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    gc.collect()
    before = counter.in_use()
    model = FSDP(_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
                 mixed_precision=mixed, cpu_offload=offload, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters())  # (on a CPU: one tensor at a time, foreach=False)
    step(model, opt)
    gc.collect()
    held = counter.in_use() - before
    counter.reset_peak()
    for _ in range(MEASURED_STEPS["fake" if simulated else "gloo"]):
        step(model, opt)
    measured = counter.peak() - before
    del model, opt
    gc.collect()
    planned = flatshard.plan(_gpt("meta"), world_size, auto_wrap_policy=ModuleWrapPolicy({Block}),
                             sharding_strategy=strategy, mixed_precision=mixed, cpu_offload=offload,
                             no_sync=variant == "no_sync", activation_bytes=activations, optimizer_foreach=False,
                             ranks_per_host=min(8 if simulated else 2, world_size),
                             backend="fake" if simulated else "gloo", device="cpu")
    memory = planned.memory
    return {"case": f"W={world_size} {strategy_name} {variant}", "rank": rank, "measured": measured,
            "planned": memory.combined_peak, "held_between_steps": held,
            "activations": getattr(activations, "peak", activations),
            "plan": memory.as_dict()}


def _freeze():
    """What the process holds now (torch's modules, the first case's lazily made state) is left out of the
    collections that bracket each measurement: each then scans only what the cases made (seconds less per case;
    what is measured is the same, counted from the bytes held before each model is built)."""
    gc.collect()
    gc.freeze()


def _gloo_rank(rank, world_size):
    os.environ["LOCAL_WORLD_SIZE"] = str(min(2, world_size))
    # What a process makes once, at its first wrap's first step (the stall watch, torch's lazily made state), is not
    # any case's.
    measure_case(rank, world_size, STRATEGIES[0], VARIANTS[0])
    _freeze()
    return [measure_case(rank, world_size, s, v) for s in STRATEGIES for v in VARIANTS]


def main(argv):
    backend, sizes = argv[0], [int(w) for w in argv[1:]]
    if backend == "gloo":
        from flatshard.testing import run_distributed

        for world_size in sizes:
            for cases in run_distributed(_gloo_rank, world_size, timeout=600):
                for case in cases:
                    print(json.dumps(case), flush=True)
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for i, world_size in enumerate(sizes):
        os.environ["LOCAL_WORLD_SIZE"] = str(min(8, world_size))
        rank = 3 if world_size > 3 else 0
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        if i == 0:  # (as for the gloo ranks)
            measure_case(rank, world_size, STRATEGIES[0], VARIANTS[0], simulated=True)
            _freeze()
        for s in STRATEGIES:
            for v in VARIANTS:
                print(json.dumps(measure_case(rank, world_size, s, v, simulated=True)), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
