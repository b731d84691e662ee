"""Scripts written for torch's FSDP2 reach flatshard through the opt-in, unchanged (issue 32).

- A torchtitan-style loop: ``from torch.distributed.fsdp import fully_shard`` on each block, each block
  ``torch.compile``d after it (``aot_eager``: no compiler on the test machine), the root; AdamW; a DCP checkpoint
  through ``torch.distributed.checkpoint.state_dict`` (model and optimizer) after 2 steps, then a fresh model
  loaded from it that goes on. Oracle: the same script with the opt-in off (torch's FSDP2), bit for bit, and the
  resumed run equal to the one that went on.
- transformers' own sharding (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``:
  ``transformers.distributed.fsdp.apply_fully_sharded_data_parallelism`` from the model's plan, which imports
  ``fully_shard`` from ``torch.distributed._composable.fsdp`` at import time): the model is flatshard's with the
  opt-in and torch's without, and both train the same, bit for bit; its ``save_pretrained`` loads into a plain
  model with torch's trained weights. With ``DistributedConfig(tp_size=2, fsdp_size=2)`` at W = 4, transformers
  applies its tensor-parallel plan first and ``fully_shard`` over the fsdp dim after (see [Note: Tensor-parallel
  parameters] in python/flatshard/_tensor_parallel.py): the same checks, and a forward without grad after training
  (transformers' TP layers then run on their local tensors, swapped into the modules' ``_parameters``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flatshard.testing import run_distributed
from models import make_gpt, train_gpt

STEPS, SAVE_AT = 4, 2


def _is_flatshard(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return bool(units) and all(getattr(m, "_is_flatshard_unit", False) for m in units)


def _titan_model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard  # torch's name, as torchtitan imports it

    import torch._dynamo as dynamo

    dynamo.reset()
    model = make_gpt(seed=seed)
    for i, block in enumerate(model.blocks):
        fully_shard(block)
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _titan_loop(rank, world_size, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _titan_model()
    kind = _is_flatshard(model)
    losses = train_gpt(model, opt, range(SAVE_AT), rank, world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    went_on = train_gpt(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    model, opt = _titan_model(seed=7)  # other weights: the checkpoint must replace them
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train_gpt(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    return {"flatshard": kind, "losses": losses + went_on, "resumed": resumed}


def _transformers_plan(rank, world_size, path, tp_size=1):
    """transformers shards the model itself from its FSDP plan (after its TP plan with ``tp_size`` > 1), as
    from_pretrained with a distributed config does."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from _frameworks import set_launcher_environment, tiny_llama

    set_launcher_environment(rank, world_size)
    if rank == 0:
        tiny_llama().save_pretrained(path)
    torch.distributed.barrier()
    dp_size, dp_rank = world_size // tp_size, rank // tp_size  # (the tp dim is the mesh's last)
    config = DistributedConfig(fsdp_size=dp_size, **({"tp_size": tp_size} if tp_size > 1 else {}))
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
    tp_params = sum(len(getattr(p, "placements", ())) == 2 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 12), generator=g).chunk(dp_size)[dp_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # (transformers runs a TP layer's no-grad forward on its local tensors, swapped into
        losses.append(model(input_ids=ids, labels=ids).loss.item())  # _parameters: see [Note: fully_shard's
        # parameters are registered, not shadowed])
    # save_pretrained of the sharded model (transformers gathers the DTensors), read back by a plain model
    model.save_pretrained(os.path.join(path, "saved"))
    torch.distributed.barrier()
    plain = AutoModelForCausalLM.from_pretrained(os.path.join(path, "saved"))
    return {"flatshard": _is_flatshard(model), "losses": losses, "tp_params": tp_params,
            "saved": {k: v.clone() for k, v in plain.state_dict().items()}}


def _both(rank, world_size, tmp, script, *args):
    from _frameworks import torch_then_flatshard

    return torch_then_flatshard(lambda impl: script(rank, world_size, os.path.join(tmp, impl), *args))


def test_torchtitan_style_loop_runs_on_flatshard_through_the_opt_in(tmp_path):
    got = run_distributed(_both, 2, str(tmp_path), _titan_loop, timeout=280)[0]
    assert got["flatshard"]["flatshard"] and not got["torch"]["flatshard"]
    assert got["flatshard"]["losses"] == got["torch"]["losses"], (got["flatshard"]["losses"], got["torch"]["losses"])
    assert got["flatshard"]["resumed"] == got["flatshard"]["losses"][SAVE_AT:], got["flatshard"]
    assert got["torch"]["resumed"] == got["torch"]["losses"][SAVE_AT:], got["torch"]


@pytest.mark.parametrize("world_size, tp_size", [(2, 1), (4, 2)], ids=["fsdp", "tp_then_fsdp"])
def test_transformers_own_fsdp_plan_runs_on_flatshard_through_the_opt_in(tmp_path, world_size, tp_size):
    pytest.importorskip("transformers")
    got = run_distributed(_both, world_size, str(tmp_path), _transformers_plan, tp_size, timeout=280)[0]
    assert got["flatshard"]["flatshard"] and not got["torch"]["flatshard"]
    if tp_size > 1:  # (parameters over the fsdp and tp dims both, as torch's)
        assert got["flatshard"]["tp_params"] == got["torch"]["tp_params"] > 0, got["flatshard"]["tp_params"]
    assert got["flatshard"]["losses"] == got["torch"]["losses"], (got["flatshard"]["losses"], got["torch"]["losses"])
    ours, theirs = got["flatshard"]["saved"], got["torch"]["saved"]
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # the trained weights, through save_pretrained into a plain model
        assert torch.equal(ours[key], value), key
