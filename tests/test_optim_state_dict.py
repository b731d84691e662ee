"""Optimizer state dicts (FULL_STATE_DICT): torch FSDP1's format, and resuming from them.

The oracle is torch's FSDP1 trained the same way: ``FSDP.optim_state_dict`` must give
the same names, param groups and values (within the parity tolerance of
tests/test_parity.py). Resuming from (model state dict, optimizer state dict) into a
fresh model must continue exactly as the uninterrupted run, and a checkpoint written
by torch's FSDP1 must load into flatshard and continue as torch does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _cases import WORLD_SIZES
from flatshard.testing import run_distributed
from models import (
    ATOL,
    RTOL,
    Block,
    fsdp_class,
    gpt_loss,
    local_slice,
    make_batch,
    make_gpt,
    param_mismatches,
)



def _build(impl: str):
    FSDP = fsdp_class(impl)
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    flat = list(model.parameters())  # the root's flat parameter first, then one per block
    opt = torch.optim.Adam([{"params": flat[:1], "lr": 1e-2}, {"params": flat[1:], "lr": 5e-3}])
    return FSDP, model, opt


def _steps(model, opt, batch, n: int) -> None:
    for _ in range(n):
        gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()


def _full_params(FSDP, model) -> dict:
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _state_problems(got: dict, want: dict, rtol: float, atol: float) -> list[str]:
    problems = []
    if list(got) != ["state", "param_groups"]:
        problems.append(f"top-level keys {list(got)}")
    if list(got["state"]) != list(want["state"]):
        problems.append(f"state names {list(got['state'])} != {list(want['state'])}")
    if got["param_groups"] != want["param_groups"]:
        problems.append(f"param_groups {got['param_groups']} != {want['param_groups']}")
    for name in set(got["state"]) & set(want["state"]):
        if set(got["state"][name]) != set(want["state"][name]):
            problems.append(f"{name}: keys {sorted(got['state'][name])} != {sorted(want['state'][name])}")
            continue
        if list(got["state"][name]) != list(want["state"][name]):
            problems.append(f"{name}: key order {list(got['state'][name])} != {list(want['state'][name])}")
        for key, value in want["state"][name].items():
            try:
                torch.testing.assert_close(got["state"][name][key], value, rtol=rtol, atol=atol)
            except AssertionError as e:
                problems.append(f"{name}[{key}]: {e}")
    return problems


def _optim_state_dicts(rank, world_size):
    batch = local_slice(make_batch(), rank, world_size)
    FS, ours, ours_opt = _build("flatshard")
    TF, theirs, theirs_opt = _build("torch")
    _steps(ours, ours_opt, batch, 3)
    _steps(theirs, theirs_opt, batch, 3)
    mine = FS.optim_state_dict(ours, ours_opt)
    ref = TF.optim_state_dict(theirs, theirs_opt)
    problems = _state_problems(mine, ref, RTOL, ATOL)
    assert not problems, "\n".join(problems[:6])
    assert "head.weight" not in mine["state"]  # the tied weight once, under its first name, as torch

    # Resume from our own checkpoint: continues exactly as the uninterrupted run.
    model_sd = ours.state_dict()
    _, resumed, resumed_opt = _build("flatshard")
    resumed.load_state_dict(model_sd)
    resumed_opt.load_state_dict(FS.optim_state_dict_to_load(resumed, resumed_opt, mine))
    assert resumed_opt.param_groups[1]["lr"] == 5e-3
    _steps(ours, ours_opt, batch, 3)
    _steps(resumed, resumed_opt, batch, 3)
    problems = param_mismatches(_full_params(FS, resumed), _full_params(FS, ours), rtol=0, atol=0)
    assert not problems, "resumed run differs:\n" + "\n".join(problems[:5])

    # Resume from torch FSDP1's checkpoint: flatshard continues as torch does.
    _, from_torch, from_torch_opt = _build("flatshard")
    from_torch.load_state_dict(theirs.state_dict())
    FS.optim_state_dict_to_load(from_torch, from_torch_opt, ref, load_directly=True)
    _steps(theirs, theirs_opt, batch, 3)
    _steps(from_torch, from_torch_opt, batch, 3)
    problems = param_mismatches(_full_params(FS, from_torch), _full_params(TF, theirs), RTOL, ATOL)
    assert not problems, "resumed from torch's checkpoint, flatshard differs from torch:\n" + "\n".join(problems[:5])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_optim_state_dict_matches_torch_and_resumes(world_size):
    run_distributed(_optim_state_dicts, world_size, timeout=180.0)


def _rank0_only(rank, world_size):
    batch = local_slice(make_batch(), rank, world_size)
    FS, model, opt = _build("flatshard")
    _steps(model, opt, batch, 2)
    full = FS.optim_state_dict(model, opt)  # the default config: every rank gets it
    with FS.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
        FullOptimStateDictConfig(rank0_only=True),
    ):
        saved = FS.optim_state_dict(model, opt)
        assert (saved == {}) == (rank != 0), f"rank {rank}: {list(saved)}"
        _, fresh, fresh_opt = _build("flatshard")
        with FS.state_dict_type(
            fresh, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
            FullOptimStateDictConfig(rank0_only=True),
        ):
            loaded = FS.optim_state_dict_to_load(fresh, fresh_opt, saved)  # rank 0's is broadcast
    want = opt.state_dict()
    for index, values in want["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(loaded["state"][index][key], value, rtol=0, atol=0)
    if rank == 0:
        assert _state_problems(saved, full, 0, 0) == []
    # The config is restored on exit: every rank gets the full dict again.
    assert FS.optim_state_dict(model, opt) != {}
    dist.barrier()


def test_rank0_only_optim_state_dict():
    run_distributed(_rank0_only, 2, timeout=120.0)


def _load_errors(rank, world_size):
    FS, model, opt = _build("flatshard")
    _steps(model, opt, local_slice(make_batch(), rank, world_size), 1)
    osd = FS.optim_state_dict(model, opt)
    del osd["state"]["blocks.0.ln1.weight"]
    try:
        FS.optim_state_dict_to_load(model, opt, osd)
    except ValueError as e:
        assert "has state for" in str(e) and "'blocks.0.ln1.weight'" in str(e) and "unit 'blocks.0'" in str(e), str(e)
    else:
        raise AssertionError("a state dict missing part of a unit was accepted")
    try:
        FS.optim_state_dict_to_load(model, opt, opt.state_dict())  # the plain one, keyed by index
    except ValueError as e:
        assert "which are not parameters of the model" in str(e) and "not optim.state_dict()" in str(e), str(e)
    else:
        raise AssertionError("optim.state_dict() was accepted as a full optimizer state dict")


def test_optim_state_dict_to_load_errors():
    run_distributed(_load_errors, 1)


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


def _nested_by_hand(rank, world_size, optimizer):
    """Units nested by hand inside a plain parent module, other optimizers: names, order and values as torch."""
    batch = local_slice(make_batch(), rank, world_size)
    out = {}
    for impl in ("flatshard", "torch"):
        FSDP = fsdp_class(impl)
        gpt = make_gpt()
        for i, block in enumerate(gpt.blocks):
            gpt.blocks[i] = FSDP(block, device_id=torch.device("cpu"))
        parent = torch.nn.ModuleDict({"lm": FSDP(gpt, device_id=torch.device("cpu"))})
        opt = OPTIMIZERS[optimizer](parent.parameters())
        for _ in range(2):
            gpt_loss(parent["lm"], *batch).backward()
            opt.step()
            opt.zero_grad()
        out[impl] = (FSDP, parent, opt, FSDP.optim_state_dict(parent, opt))
    mine, ref = out["flatshard"][3], out["torch"][3]
    assert list(ref["state"])[0] == "lm.pos"  # the names torch gives, prefix included
    problems = _state_problems(mine, ref, RTOL, ATOL)
    assert not problems, "\n".join(problems[:6])
    FS, parent, opt, _ = out["flatshard"]
    loaded = FS.optim_state_dict_to_load(parent, opt, ref)
    want = opt.state_dict()
    assert sorted(loaded["state"]) == sorted(want["state"])
    for index, values in want["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(loaded["state"][index][key], value, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_nested_by_hand_other_optimizers_match_torch(optimizer):
    run_distributed(_nested_by_hand, 2, optimizer, timeout=120.0)
