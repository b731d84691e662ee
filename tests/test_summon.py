"""``summon_full_params`` options, for both settings of ``use_orig_params``.

Acceptance (issue 9): ``with_grads=True`` shows the full gradient (equal to a
single-process run's on the same global batch) and, with ``writeback``, writes edits to
it back; ``rank0_only=True`` shows full parameters on the first rank only (the others keep
their sharded state) and, unlike torch's FSDP1 which refuses it, also writes back the first
rank's edits to every rank; ``offload_to_cpu=True`` shows them on the host; the sharded
state comes back after the context. See [Note: Summoning] in _full_params.py. The
combinations torch's FSDP1 refuses go through ``flatshard.summon_full_params``;
``FSDP.summon_full_params`` refuses them as torch does (tests/test_torch_conformance.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import ATOL, RTOL, Block, gpt_loss, local_slice, make_batch, make_gpt


def _reference_grads() -> dict:
    model = make_gpt()
    gpt_loss(model, *make_batch()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _options(rank, world_size, use_orig_params) -> dict:
    import flatshard
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()
    want = _reference_grads()
    out = {}
    with flatshard.summon_full_params(model, with_grads=True, offload_to_cpu=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["devices"] = sorted({p.device.type for p in model.parameters()})
    assert set(grads) == set(want), sorted(set(grads) ^ set(want))
    for n, g in want.items():
        torch.testing.assert_close(grads[n], g, rtol=RTOL, atol=ATOL, msg=f"full gradient of '{n}'")
    # writeback with_grads: doubling the full gradients doubles every rank's shards.
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with flatshard.summon_full_params(model, with_grads=True):
        for p in model.parameters():
            p.grad.mul_(2)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(before) == len(after) and all(torch.equal(a, 2 * b) for a, b in zip(after, before))
    # rank0_only: full shapes on rank 0 only; the others keep what they hold between iterations.
    out["sharded_shapes"] = [tuple(p.shape) for p in model.parameters()]
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        out["rank0_only_shapes"] = [tuple(p.shape) for p in model.parameters()]
        out["rank0_only_names"] = sorted(n for n, _ in model.named_parameters())[:3]
        out["ln_f_shape"] = [tuple(p.shape) for n, p in model.named_parameters() if n == "ln_f.weight"]
    # rank0_only with writeback: rank 0's edit reaches every rank.
    with flatshard.summon_full_params(model, rank0_only=True, writeback=True):
        if rank == 0:
            with torch.no_grad():
                model.module.ln_f.weight.fill_(3.0)
    with FSDP.summon_full_params(model):
        out["ln_f_after"] = model.module.ln_f.weight.detach().clone()
    return out


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_options(use_orig_params):
    got = run_distributed(_options, 2, use_orig_params)
    for rank, r in enumerate(got):
        assert r["devices"] == ["cpu"]
        assert torch.equal(r["ln_f_after"], torch.full((16,), 3.0)), f"rank {rank}: {r['ln_f_after']}"
    assert got[0]["ln_f_shape"] == [(16,)], got[0]
    assert got[0]["rank0_only_shapes"] != got[0]["sharded_shapes"]
    assert got[1]["rank0_only_shapes"] == got[1]["sharded_shapes"], "rank 1 must keep its sharded state"
    if not use_orig_params:  # rank 1 sees the flat shards, not the original parameters
        assert all(n.endswith("_flat_param") for n in got[1]["rank0_only_names"]), got[1]


def _move_inside(rank, world_size, use_orig_params):
    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()
    opt.step()
    opt.zero_grad()
    shards = [p.detach().clone() for p in model.parameters()]
    with FSDP.summon_full_params(model, writeback=False):
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        inner = model.module.to(torch.float64)  # verl moves the inner module with .to("cpu") here
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        inner.to(torch.float32)
    assert {p.dtype for p in got.values()} == {torch.float64}
    for n, v in want.items():
        assert torch.equal(got[n], v.double()), n
    after = [p.detach() for p in model.parameters()]
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(after, shards))
    with FSDP.summon_full_params(model, writeback=True):  # edits after a cast inside the context are written back
        model.module.to(torch.float64)
        with torch.no_grad():
            model.module.ln_f.weight.fill_(2.0)
        model.module.to(torch.float32)
    with FSDP.summon_full_params(model):
        assert torch.equal(model.module.ln_f.weight, torch.full((16,), 2.0))
    gpt_loss(model, *local_slice(make_batch(), rank, world_size)).backward()  # trains on
    opt.step()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_module_moved_or_cast_inside_summon_moves_the_full_parameters_only(use_orig_params):
    """``.to()`` inside the context applies to the full parameters it shows (as torch's); the shards stay."""
    run_distributed(_move_inside, 2, use_orig_params)
