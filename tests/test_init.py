"""Initialization: a model built on the meta device, param_init_fn, sync_module_states.

A large model is built on the meta device and materialized unit by unit as it is
wrapped. Here rank 0's ``param_init_fn`` writes the reference model's values (as a
script that loads a checkpoint on rank 0 would) and every other rank writes garbage;
``sync_module_states=True`` must make every rank start from rank 0's values, so that
training then matches a single-process run. Without it the ranks must disagree (the
check can fail). torch's FSDP1 refuses ``sync_module_states`` with CPU tensors
("requires them to be on GPU"); flatshard broadcasts over whatever the group is.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import ATOL, RTOL, Block, gpt_loss, local_slice, make_batch, make_gpt, param_mismatches

STEPS = 5


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _meta_gpt_and_init_fn(rank: int):
    """A GPT on the meta device and a param_init_fn: rank 0 writes the reference values, others garbage."""
    ref = make_gpt()
    want = {**dict(ref.named_parameters(remove_duplicate=False)), **dict(ref.named_buffers())}
    with torch.device("meta"):
        model = make_gpt()
    prefix_of = {m: n for n, m in model.named_modules()}
    calls: list[str] = []

    def param_init_fn(module: nn.Module) -> None:
        prefix = prefix_of[module]
        calls.append(prefix)
        module.to_empty(device="cpu", recurse=False)
        if prefix == "head":  # to_empty unties: re-tie, as a user's script must (embed came first)
            module.weight = model.embed.weight
            return
        with torch.no_grad():
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if rank == 0:
                    t.copy_(want[_join(prefix, name)])
                else:
                    t.fill_(rank + 7)

    return model, param_init_fn, calls, prefix_of, ref


def _train_from_meta(rank, world_size, sync, strategy):
    from flatshard import FullyShardedDataParallel as FSDP

    model, param_init_fn, calls, prefix_of, ref = _meta_gpt_and_init_fn(rank)
    kwargs = {}
    if strategy == "hybrid":  # 2 groups of 2: shard within, replicate across
        kwargs["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    fsdp = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        param_init_fn=param_init_fn,
        sync_module_states=sync,
        **kwargs,
    )
    # torch's order and coverage: once per module of each unit, breadth-first.
    assert sorted(calls) == sorted(prefix_of.values()), calls
    assert calls.index("") < calls.index("embed") < calls.index("head"), calls
    with FSDP.summon_full_params(fsdp):
        assert fsdp.module.head.weight is fsdp.module.embed.weight, "the re-tie was lost"
        start = {n: p.detach().clone() for n, p in fsdp.named_parameters()}
    start_problems = param_mismatches(start, dict(ref.named_parameters()), rtol=0, atol=0)
    mask = fsdp.module.blocks[1].module.attn.causal_mask
    mask_ok = bool(torch.equal(mask, torch.ones_like(mask).tril()))
    if not sync:
        return {"start_problems": len(start_problems), "mask_ok": mask_ok}
    assert not start_problems, start_problems
    assert mask_ok, "buffers were not synchronized"

    tokens, targets = make_batch()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    local = local_slice((tokens, targets), rank, world_size)
    for _ in range(STEPS):
        gpt_loss(ref, tokens, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gpt_loss(fsdp, *local).backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(fsdp):
        full = {n: p.detach().clone() for n, p in fsdp.named_parameters()}
    problems = param_mismatches(full, dict(ref.named_parameters()), RTOL, ATOL)
    assert not problems, "\n".join(problems[:5])
    return {"start_problems": 0, "mask_ok": True}


@pytest.mark.parametrize("world_size, strategy", [(1, "full"), (2, "full"), (4, "full"), (4, "hybrid")])
def test_param_init_fn_and_sync_module_states_then_parity(world_size, strategy):
    run_distributed(_train_from_meta, world_size, True, strategy, timeout=120.0)


def test_without_sync_module_states_ranks_keep_their_own_values():
    results = run_distributed(_train_from_meta, 2, False, "full", timeout=120.0)
    # Rank 1's garbage stays in its shards and buffers: the check above can fail.
    assert all(r["start_problems"] > 0 for r in results), results
    assert results[0]["mask_ok"] and not results[1]["mask_ok"], results


def _init_errors(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    try:
        FSDP(nn.Linear(2, 2), param_init_fn="reset")
    except ValueError as e:
        assert "Expected reset to be callable but got <class 'str'>" in str(e), str(e)  # torch's phrase
    else:
        raise AssertionError("a non-callable param_init_fn was accepted")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    try:
        FSDP(model, param_init_fn=lambda m: None)
    except ValueError as e:
        assert "'0.weight' is still on the meta device after param_init_fn ran on module '0'" in str(e), str(e)
        assert "to_empty(device=..., recurse=False)" in str(e), str(e)
    else:
        raise AssertionError("a param_init_fn that left meta tensors was accepted")
    # A module that is not on the meta device is not passed to param_init_fn (as torch).
    seen = []
    FSDP(nn.Linear(2, 2), param_init_fn=seen.append)
    assert seen == []
    # A tie split across units is reported as without param_init_fn, not silently untied.
    from models import TiedLM

    with torch.device("meta"):
        split = TiedLM()
    try:
        FSDP(split, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"),
             param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False))
    except ValueError as e:
        assert "tied parameters must live in one unit" in str(e) and "'emb.weight'" in str(e), str(e)
    else:
        raise AssertionError("a tie split across units was not reported with param_init_fn")
    dist.barrier()


def _call_order(rank, world_size):
    from flatshard import FullyShardedDataParallel as FSDP

    with torch.device("meta"):
        model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    prefix_of = {m: n for n, m in model.named_modules()}
    calls = []

    def param_init_fn(m):
        calls.append(prefix_of[m])
        m.to_empty(device="cpu", recurse=False)

    FSDP(model, param_init_fn=param_init_fn)
    return calls


def test_param_init_fn_is_called_breadth_first_like_torch():
    # torch's _get_modules_to_materialize: a breadth-first walk from the unit's root.
    (calls,) = run_distributed(_call_order, 1)
    assert calls == ["", "0", "1", "0.0", "0.1", "1.0"], calls


def test_param_init_fn_errors():
    run_distributed(_init_errors, 1)
