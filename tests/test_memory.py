"""Between steps each rank holds only its shards, and no unsharded buffer is alive
(also with bf16 mixed precision, whose placeholders are made from a buffer of their own)."""

import pytest
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _cases import WORLD_SIZES
from flatshard.testing import run_distributed
from models import Block, gpt_loss, local_slice, make_batch, make_gpt


def _memory_between_steps(rank: int, world_size: int, mixed: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecision

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import _C

    reference = make_gpt()
    total = sum(p.numel() for p in reference.parameters())  # tied weight counted once
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mixed else None)
    units = [u for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = local_slice(make_batch(), rank, world_size)
    _C.reset_peak_unsharded_bytes()
    for _ in range(3):
        gpt_loss(model, *batch).backward()
        opt.step()
        # Gradients are shards too, before zero_grad frees them.
        for u in units:
            assert u._flat_param.grad is not None
            assert u._flat_param.grad.shape == u._flat_param.shape
        opt.zero_grad()
        # No unsharded buffer alive between steps, by the core's counter and by storage.
        assert _C.unsharded_bytes() == 0
        for u in units:
            assert not u._unit_state.handle.has_unsharded_storage()
            if world_size > 1 or mixed:  # at W=1 in fp32 the shard is the whole parameter: no buffer exists
                assert u._unit_state.handle.unsharded.untyped_storage().nbytes() == 0
            if world_size > 1:  # nor does what the placeholders are views of (their base) hold memory
                for v in u._unit_state.handle.placeholder_views:
                    assert v._base is None or v._base.untyped_storage().nbytes() == 0
        for name, p in model.named_parameters():
            assert name.endswith("_flat_param"), name

    held = sum(p.numel() for p in model.parameters())
    # Each unit holds padded/W elements: about total/W plus at most W-1 padding elements per unit.
    assert held == sum(u._unit_state.handle.layout.padded_numel for u in units) // world_size
    assert total / world_size <= held <= total / world_size + len(units) * (world_size - 1) / world_size
    for u in units:
        assert u._unit_state.handle.layout.padding_numel < world_size
        assert u._flat_param.numel() == u._unit_state.handle.layout.padded_numel // world_size
    # The original parameters' module attributes hold no storage between steps.
    block = model.module.blocks[0].module
    assert block.ln1.weight.shape == (16,)
    if world_size > 1:  # no storage at all: touching the values is an error naming the unit, not a crash
        try:
            block.ln1.weight.untyped_storage()
        except RuntimeError as e:
            assert "unit 'blocks.0' has no storage between iterations" in str(e), str(e)
        else:
            raise AssertionError("a sharded unit's parameter attribute had storage between steps")
    # During the step, at most the root and one block (plus the next one in flight) were unsharded.
    largest = max(u._unit_state.handle.unsharded_nbytes for u in units)
    if world_size > 1:
        assert 0 < _C.peak_unsharded_bytes() <= 3 * largest
    elif mixed:  # one rank: every unit's bf16 copy lives from its forward to its backward (torch FSDP1 too)
        assert 0 < _C.peak_unsharded_bytes() <= sum(u._unit_state.handle.unsharded_nbytes for u in units)
    else:
        assert _C.peak_unsharded_bytes() == 0
    return {"held": held, "total": total}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_only_shards_alive_between_steps(world_size, mixed):
    results = run_distributed(_memory_between_steps, world_size, mixed)
    assert len({r["held"] for r in results}) == 1
