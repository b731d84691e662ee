"""clip_grad_norm_ over sharded gradients equals the single-process clip, for flatshard and torch FSDP1."""

import functools

import pytest
import torch
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import ATOL, RTOL, Block, fsdp_class, gpt_loss, local_slice, make_batch, make_gpt

MAX_NORM = 0.05  # small enough that every step clips


def _first_block_no_shard(model, module):
    if module is model.blocks[0]:
        return {"sharding_strategy": ShardingStrategy.NO_SHARD}
    return isinstance(module, Block)


def _train_with_clipping(rank, world_size, impl, mixed, norm_type):
    FSDP = fsdp_class(impl)
    batch = make_batch()
    reference = make_gpt()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    model = make_gpt()
    policy = CustomPolicy(functools.partial(_first_block_no_shard, model)) if mixed else ModuleWrapPolicy({Block})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    local = local_slice(batch, rank, world_size)
    for step in range(3):
        gpt_loss(reference, *batch).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type=norm_type)
        ref_opt.step()
        ref_opt.zero_grad()
        gpt_loss(model, *local).backward()
        norm = model.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
        assert ref_norm > MAX_NORM  # the clip is exercised
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL, msg=f"total norm at step {step}")
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("impl", ["flatshard", "torch"])
@pytest.mark.parametrize(
    "world_size, mixed, norm_type", [(2, False, 2.0), (4, False, 2.0), (2, True, 2.0), (2, False, float("inf"))]
)
def test_clip_grad_norm_matches_single_process(impl, world_size, mixed, norm_type):
    run_distributed(_train_with_clipping, world_size, impl, mixed, norm_type)


def _nested_unit_refuses(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()
    try:
        model.module.blocks[0].clip_grad_norm_(1.0)
    except RuntimeError as e:
        assert "call it on the outermost FSDP module" in str(e) and "'blocks.0'" in str(e)
    else:
        raise AssertionError("clip_grad_norm_ on a nested unit did not raise")


def test_clip_grad_norm_on_nested_unit_is_an_error():
    run_distributed(_nested_unit_refuses, 2)
