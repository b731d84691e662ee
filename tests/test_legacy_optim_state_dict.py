"""torch's older optimizer-state functions, as recipes still call them.

Acceptance (issue 9): ``full_optim_state_dict`` gives torch FSDP1's dict (names, groups,
values) on rank 0 and ``{}`` elsewhere (all ranks with ``rank0_only=False``);
``shard_full_optim_state_dict`` (every rank holds the dict) and
``scatter_full_optim_state_dict`` (rank 0 does) load it so that training resumes exactly
as if it had not stopped; ``rekey_optim_state_dict`` turns it into a dict keyed by
position that an unwrapped model's optimizer loads, and back. See [Note: Older
optimizer-state functions] in _optim_state_dict.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.fsdp import OptimStateKeyType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import Block, fsdp_class, gpt_loss, local_slice, make_batch, make_gpt


def _build(impl):
    FSDP = fsdp_class(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    return FSDP, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _steps(model, opt, local, n):
    for _ in range(n):
        gpt_loss(model, *local).backward()
        opt.step()
        opt.zero_grad()


def _full(rank, world_size, impl, rank0_only) -> dict:
    FSDP, model, opt = _build(impl)
    _steps(model, opt, local_slice(make_batch(), rank, world_size), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        osd = FSDP.full_optim_state_dict(model, opt, rank0_only=rank0_only)
    return osd


@pytest.mark.parametrize("rank0_only", [True, False])
def test_full_optim_state_dict_like_torch(rank0_only):
    ours = run_distributed(_full, 2, "flatshard", rank0_only)
    theirs = run_distributed(_full, 2, "torch", rank0_only)
    for rank in range(2):
        if rank0_only and rank:
            assert ours[rank] == {} and theirs[rank] == {}
            continue
        assert ours[rank]["param_groups"] == theirs[rank]["param_groups"]
        assert sorted(ours[rank]["state"]) == sorted(theirs[rank]["state"])
        for name, state in theirs[rank]["state"].items():
            for k, v in state.items():
                torch.testing.assert_close(ours[rank]["state"][name][k], v, rtol=0, atol=0, msg=f"{name}.{k}")


def _resume(rank, world_size, how) -> dict:
    FSDP, model, opt = _build("flatshard")
    local = local_slice(make_batch(), rank, world_size)
    _steps(model, opt, local, 2)
    full = FSDP.full_optim_state_dict(model, opt, rank0_only=(how == "scatter"))
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    _steps(model, opt, local, 2)  # the uninterrupted run
    with FSDP.summon_full_params(model):
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, fresh, fresh_opt = _build("flatshard")
    with FSDP.summon_full_params(fresh):
        for n, p in fresh.named_parameters():
            p.data.copy_(params[n])
    if how == "shard":
        loaded = FSDP.shard_full_optim_state_dict(full, fresh, optim=fresh_opt)
    else:
        loaded = FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, fresh, optim=fresh_opt)
    fresh_opt.load_state_dict(loaded)
    _steps(fresh, fresh_opt, local, 2)
    with FSDP.summon_full_params(fresh):
        got = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    for n, v in want.items():
        torch.testing.assert_close(got[n], v, rtol=0, atol=0, msg=f"rank {rank}: '{n}' after resuming")
    # rekey: by position, into an unwrapped model's optimizer, and back.
    if rank == 0 or how == "shard":
        by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, fresh)
        plain = make_gpt()
        plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
        plain_opt.load_state_dict(by_id)
        names = [n for n, _ in plain.named_parameters()]
        for i, p in enumerate(plain.parameters()):
            torch.testing.assert_close(plain_opt.state[p]["exp_avg"], full["state"][names[i]]["exp_avg"])
        back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, fresh)
        assert sorted(back["state"]) == sorted(full["state"])
        assert [sorted(g["params"]) for g in back["param_groups"]] == [sorted(g["params"]) for g in full["param_groups"]]
    return True


@pytest.mark.parametrize("how", ["shard", "scatter"])
def test_shard_and_scatter_full_optim_state_dict_resume_exactly(how):
    run_distributed(_resume, 2, how)
