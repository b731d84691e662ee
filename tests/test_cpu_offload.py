"""``CPUOffload(offload_params=True)`` trains to the same results as without it.

Acceptance (issue 8), at world sizes 1 and 2, for FULL_SHARD, NO_SHARD and bf16 mixed
precision: the same per-step losses, gradient norms (``clip_grad_norm_``), final
parameters (``summon_full_params``) and FULL state dict as the run without offload, bit
for bit, the same optimizer state dict keys, and parameters and gradients on the host.

What this test does and does not exercise: on this CPU-only machine the shards' "host"
and "device" are the same memory. The compute device is the CPU, so each unit's
``FlatParamHandle`` turns offload off (csrc/flatshard/flat_param.cpp: "On a CPU-only run the
host is the compute device"; ``handle.offload`` reads False) and trains exactly as
without it; torch's FSDP1 refuses offload here altogether, so there is no torch oracle.
What is checked is the option's plumbing and the numerics with it set: ``cpu_offload``
accepted by every unit, and nothing changed by it on the host, bf16 mixed precision's
casts included: the optimizer stepping the host shards, clipping, summoning, the FULL
state dict and the optimizer state dict's keys are those of the run without it. Not
exercised here: pinned host shards, their cast and copy to the device before each
all-gather, the reduced gradient shards copied back to pinned host memory and added into
``.grad`` at the end of backward, the overlap of those copies with compute on their
streams, and the device memory offload saves. On a GPU, ``test_bf16_and_offload_on_gpu``
in tests/test_gpu.py (NCCL at world size 1, gloo at 2, bf16) runs that code: it checks
that the shards are pinned host memory and that the losses equal the run without offload
(so the copies both ways are right). No test measures the overlap or the memory saving.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt

STEPS = 4


def _train(rank, world_size, strategy, mixed, offload) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(
        make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy],
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mixed else None,
        cpu_offload=CPUOffload(offload_params=offload),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    local = local_slice(make_batch(), rank, world_size)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = gpt_loss(model, *local).float()
        loss.backward()
        assert all(p.grad.device.type == "cpu" for p in model.parameters())
        norms.append(float(model.clip_grad_norm_(1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = model.state_dict()
    osd = FSDP.optim_state_dict(model, opt)
    return {"losses": losses, "norms": norms, "params": params, "state": state,
            "osd_keys": sorted(osd["state"]), "devices": sorted({p.device.type for p in model.parameters()})}


def _with_and_without(rank, world_size, strategy, mixed) -> dict:
    return {offload: _train(rank, world_size, strategy, mixed, offload) for offload in (False, True)}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("strategy, mixed", [("FULL_SHARD", False), ("NO_SHARD", False), ("FULL_SHARD", True)],
                         ids=["full_shard", "no_shard", "full_shard-bf16"])
def test_offload_trains_like_no_offload(world_size, strategy, mixed):
    for rank, got in enumerate(run_distributed(_with_and_without, world_size, strategy, mixed)):
        plain, offloaded = got[False], got[True]
        assert offloaded["devices"] == ["cpu"]
        assert offloaded["losses"] == plain["losses"], f"rank {rank}: {offloaded['losses']} vs {plain['losses']}"
        assert offloaded["norms"] == plain["norms"]
        assert offloaded["osd_keys"] == plain["osd_keys"]
        for what in ("params", "state"):
            assert set(offloaded[what]) == set(plain[what])
            for name, value in plain[what].items():
                torch.testing.assert_close(offloaded[what][name], value, rtol=0, atol=0,
                                           msg=f"rank {rank}: {what} '{name}'")
