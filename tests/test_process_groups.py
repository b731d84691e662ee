"""Units of one root over different process groups (mixture-of-experts).

Acceptance (issue 9): a model whose expert layer is sharded over an expert group (ranks
{0, 1} and {2, 3} at world size 4, each group training its own copy) while the rest is
sharded over the world trains with the same per-step losses and final parameters as
torch's FSDP1 on the same script. Each unit's collectives run on its own group, from one
scheduler in one order ([Note: Groups per unit] in csrc/flatshard/scheduler.h).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from flatshard.testing import run_distributed
from models import fsdp_class, gpt_loss, local_slice, make_batch, make_gpt


def _train(rank, world_size, impl, strategy) -> dict:
    from torch.distributed.fsdp import ShardingStrategy

    FSDP = fsdp_class(impl)
    experts = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    expert_group = experts[rank // 2]
    model = make_gpt()
    kwargs = dict(device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy[strategy])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block, process_group=expert_group if i == 1 else None, **kwargs)
        model = FSDP(model, **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    local = local_slice(make_batch(), rank, world_size)
    losses = []
    for _ in range(4):
        loss = gpt_loss(model, *local)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with FSDP.summon_full_params(model):
        params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _both(rank, world_size, strategy):
    return {impl: _train(rank, world_size, impl, strategy) for impl in ("torch", "flatshard")}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_expert_unit_over_its_own_group_like_torch(strategy):
    for rank, got in enumerate(got_all(strategy)):
        ours, theirs = got["flatshard"], got["torch"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-6, atol=0,
                                   msg=f"rank {rank}: losses {ours['losses']} vs torch {theirs['losses']}")
        for n, v in theirs["params"].items():
            torch.testing.assert_close(ours["params"][n], v, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: '{n}'")
    # The experts differ between the groups (each trained on its own data); the rest does not.
    expert = [r["flatshard"]["params"]["blocks.1.mlp.fc.weight"] for r in got_all(strategy)]
    assert torch.equal(expert[0], expert[1]) and torch.equal(expert[2], expert[3])
    assert not torch.equal(expert[0], expert[2])


_CACHE: dict = {}


def got_all(strategy):
    if strategy not in _CACHE:
        _CACHE[strategy] = run_distributed(_both, 4, strategy, timeout=240)
    return _CACHE[strategy]
