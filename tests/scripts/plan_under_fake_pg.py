"""One process playing rank 3 of W-rank jobs under torch's fake process group (tests/test_plan.py).

For each W given on the command line, each strategy and dtype: wraps the tests' GPT, runs a
first step (lazy init), resets the runtime's per-unit byte counters, runs one more, and prints
one JSON line with the counted bytes per unit and ``flatshard.plan``'s for the same model on the
meta device. Hybrid sharding uses shard groups of 8 (LOCAL_WORLD_SIZE).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flatshard  # noqa: E402
from flatshard import FullyShardedDataParallel as FSDP  # noqa: E402
from models import GPT, Block, gpt_loss, make_batch, make_gpt  # noqa: E402

os.environ["LOCAL_WORLD_SIZE"] = "8"
for world_size in map(int, sys.argv[1:]):
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=world_size)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
                     ShardingStrategy.HYBRID_SHARD):
        for mixed in (None, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)):
            model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
                         mixed_precision=mixed, device_id=torch.device("cpu"))
            gpt_loss(model, *make_batch()).backward()
            units = [u for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None]
            for u in units:
                u._unit_state.handle.reset_collective_bytes()
            gpt_loss(model, *make_batch()).backward()
            with torch.device("meta"):
                meta = GPT(64, 16, 3, 4, 16)
            planned = flatshard.plan(meta, world_size, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                     sharding_strategy=strategy, mixed_precision=mixed, ranks_per_host=8)
            print(json.dumps({
                "case": f"W={world_size} {strategy.name} {'bf16' if mixed else 'fp32'}",
                "counted": {u._unit_state.name: u._unit_state.handle.collective_bytes for u in units},
                "planned": {u.name: t.as_dict() for u, t in zip(planned.units, planned.traffic)},
            }), flush=True)
    dist.destroy_process_group()
