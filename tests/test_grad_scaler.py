"""fp16 mixed precision with torch's ``ShardedGradScaler``, against torch's FSDP1.

Acceptance (issue 8): the same fp16 script (``MixedPrecision(param_dtype=float16)``,
``ShardedGradScaler``) follows torch FSDP1's loss curve and scale, including a step where
one rank alone sees an inf: an inf written into rank 1's gradient shard after step
``INF_STEP``'s backward. ``ShardedGradScaler`` all-reduces what each rank found, so every
rank must skip that step (parameters unchanged) and halve the scale.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, fsdp_class, gpt_loss, local_slice, make_batch, make_gpt

STEPS = 6
INF_STEP = 3
LR = 0.3


def _train(rank, world_size, impl) -> dict:
    FSDP = fsdp_class(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                     mixed_precision=MixedPrecision(param_dtype=torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=2)
    local = local_slice(make_batch(), rank, world_size)
    losses, scales, changed = [], [], []
    for step in range(STEPS):
        loss = gpt_loss(model, *local)
        scaler.scale(loss).backward()
        if step == INF_STEP and rank == 1:
            next(iter(model.parameters())).grad[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        losses.append(float(loss))
        scales.append(float(scaler.get_scale()))
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "scales": scales, "changed": changed, "params": params}


def _both(rank, world_size) -> dict:
    return {impl: _train(rank, world_size, impl) for impl in ("torch", "flatshard")}


def test_fp16_with_sharded_grad_scaler_follows_torch():
    for rank, got in enumerate(run_distributed(_both, 2)):
        ours, theirs = got["flatshard"], got["torch"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}: losses {ours['losses']} vs torch {theirs['losses']}"
        assert ours["scales"] == theirs["scales"], f"rank {rank}: scales {ours['scales']} vs torch {theirs['scales']}"
        # The inf on rank 1 alone skips the step everywhere and halves the scale.
        assert ours["changed"] == [step != INF_STEP for step in range(STEPS)], f"rank {rank}: {ours['changed']}"
        assert ours["scales"][INF_STEP] == ours["scales"][INF_STEP - 1] / 2, ours["scales"]
        for name, p in theirs["params"].items():
            torch.testing.assert_close(ours["params"][name], p, rtol=0, atol=0, msg=f"rank {rank}: {name}")
