"""``register_comm_hook``: torch's default hooks and a user's hook, as with torch's FSDP1.

Acceptance (issue 9): with torch's default hooks (``allreduce_hook`` for NO_SHARD,
``reduce_scatter_hook`` for sharded units) and a user's hook with its own state (here
also a bf16-compressing one written for the CPU), the same script gives the same per-step
losses as torch's FSDP1 at world size 2, and the hook is called as torch calls it (once per
unit per backward, with the unit's padded flat gradient and, sharded, an output of one
shard). torch's ``fp16_compress_hook`` and ``bf16_compress_hook`` fail on the CPU in torch
itself (their ``_decompress`` calls ``record_stream`` on a CPU tensor: "unknown parameter
type"), with torch's FSDP1 as with flatshard; tests/test_gpu.py runs them on a GPU. See
[Note: Communication hooks] in _comm_hooks.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, fsdp_class, gpt_loss, local_slice, make_batch, make_gpt


class CountingSumState:
    """A user's hook state: counts calls and records the shapes it was given."""

    def __init__(self, group):
        self.group, self.calls, self.shapes = group, 0, set()


def counting_sum_hook(state, grad, output=None):
    """SUM, then divide by the world size, and count."""
    state.calls += 1
    state.shapes.add((tuple(grad.shape), None if output is None else tuple(output.shape)))
    if output is None:
        dist.all_reduce(grad, group=state.group)
        grad.div_(dist.get_world_size(state.group))
    else:
        dist.reduce_scatter_tensor(output, grad, group=state.group)
        output.div_(dist.get_world_size(state.group))


def bf16_sum_hook(state, grad, output=None):
    """A user's compressing hook: the reduction in bf16, the result back in the gradient's dtype."""
    state.calls += 1
    state.shapes.add((tuple(grad.shape), None if output is None else tuple(output.shape)))
    low = grad.to(torch.bfloat16)
    if output is None:
        dist.all_reduce(low, group=state.group)
        grad.copy_(low.float() / dist.get_world_size(state.group))
    else:
        out = torch.empty(output.shape, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, low, group=state.group)
        output.copy_(out.float() / dist.get_world_size(state.group))


HOOKS = {
    "allreduce": ("NO_SHARD", default_hooks.allreduce_hook, default_hooks.DefaultState),
    "reduce_scatter": ("FULL_SHARD", default_hooks.reduce_scatter_hook, default_hooks.DefaultState),
    "reduce_scatter-shard_grad_op": ("SHARD_GRAD_OP", default_hooks.reduce_scatter_hook, default_hooks.DefaultState),
    "user": ("FULL_SHARD", counting_sum_hook, CountingSumState),
    "user-no_shard": ("NO_SHARD", counting_sum_hook, CountingSumState),
    "user-bf16": ("FULL_SHARD", bf16_sum_hook, CountingSumState),
}


def _train(rank, world_size, impl, name) -> dict:
    strategy, hook, state_cls = HOOKS[name]
    FSDP = fsdp_class(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                     sharding_strategy=ShardingStrategy[strategy])
    state = state_cls(dist.group.WORLD)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = local_slice(make_batch(), rank, world_size)
    losses = []
    for _ in range(3):
        loss = gpt_loss(model, *local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "calls": getattr(state, "calls", None), "shapes": sorted(getattr(state, "shapes", ()))}


def _both(rank, world_size, name):
    return {impl: _train(rank, world_size, impl, name) for impl in ("torch", "flatshard")}


@pytest.mark.parametrize("name", list(HOOKS))
def test_comm_hook_like_torch(name):
    for rank, got in enumerate(run_distributed(_both, 2, name)):
        ours, theirs = got["flatshard"], got["torch"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-6, atol=0,
                                   msg=f"rank {rank}: losses {ours['losses']} vs torch {theirs['losses']}")
        assert ours["calls"] == theirs["calls"] and ours["shapes"] == theirs["shapes"], (ours, theirs)


def _errors(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(torch.nn.Sequential(FSDP(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)))
    model(torch.ones(1, 2))  # the root is known from the first forward on
    state = default_hooks.DefaultState(dist.group.WORLD)
    with pytest.raises(AssertionError, match=r"register_comm_hook: expected the root unit"):
        model.module[0].register_comm_hook(state, default_hooks.allreduce_hook)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    with pytest.raises(RuntimeError, match=r"a communication hook is already registered"):
        model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    hybrid = FSDP(torch.nn.Linear(2, 2), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(RuntimeError, match=r"HYBRID_SHARD, which takes no communication hook"):
        hybrid.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def test_comm_hook_errors():
    run_distributed(_errors, 2)
