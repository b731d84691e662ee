"""Small units gathered and reduced together (see [Note: Small units gathered together] in
csrc/flatshard/scheduler.h and [Note: fully_shard gathers small units together] in _fsdp2_config.py).

A stack of 12 small ``fully_shard`` blocks trains three AdamW steps beside torch's FSDP2 on the same script, at
W = 2 (where the reduce-scatters go together too) and W = 4 (the all-gathers only): losses, gradients and
parameters bit-equal, and fewer collectives issued than units (the ``flatshard::all_gather`` and
``flatshard::reduce_scatter`` scopes of a profiled step, one per collective). The cases change what a group may
hold or how the forward runs:
- ``plain``: every block alike;
- ``mixed``: block 4 computes in bf16 (another all-gather dtype: it cannot join fp32 ones) and block 7 is frozen
  (no use left in backward);
- ``leaves_order``: the second step's forward skips block 5 (the gathered-ahead units past it are resharded, and
  nothing is left unsharded after the step), the third runs every block again;
- ``one_per_unit``: FLATSHARD_GATHER_TOGETHER_BYTES=0 (torch's one all-gather per unit; as many scopes as units);
- ``unit_without_parameters_on_rank_0``: a parameterless module given its own ``fully_shard`` runs after block 1 on
  rank 0 only (torch's FSDP2 trains this): it must not change which units the ranks gather together, nor the order
  of their collectives (see [Note: The orders hold units that gather] in _prefetch.py); with ``_one_per_unit`` too.
In ``plain`` and ``one_per_unit`` the forward's peak of unsharded bytes is also what ``flatshard.plan`` says.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from _cases import CaseRun

N_BLOCKS, DIM, STEPS, LR = 12, 8, 3, 1e-2
CASES = ["plain", "mixed", "leaves_order", "one_per_unit", "unit_without_parameters_on_rank_0",
         "unit_without_parameters_on_rank_0_one_per_unit"]


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(N_BLOCKS))
        self.act = nn.Sequential(nn.Tanh())  # no parameters
        self.skip: int | None = None
        self.use_act = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = x + block(x)
            if i == 1 and self.use_act:
                x = self.act(x)
        return x


def _build(impl: str, case: str) -> _Stack:
    if impl == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _Stack()
    if case == "mixed":
        model.blocks[7].requires_grad_(False)
    for i, block in enumerate(model.blocks):
        bf16 = case == "mixed" and i == 4
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else
                    MixedPrecisionPolicy())
    if case.startswith("unit_without_parameters"):
        fully_shard(model.act)
    fully_shard(model)
    return model


def _scopes(events, name: str) -> int:
    return sum(1 for e in events if e.name.startswith(name))


def _case(rank: int, world_size: int, case: str) -> dict:
    from flatshard import _C

    os.environ["FLATSHARD_GATHER_TOGETHER_BYTES"] = "0" if case.endswith("one_per_unit") else str(256 * 1024)
    try:
        models = {impl: _build(impl, case) for impl in ("torch", "flatshard")}
        for model in models.values():
            model.use_act = case.startswith("unit_without_parameters") and rank == 0
    finally:
        os.environ.pop("FLATSHARD_GATHER_TOGETHER_BYTES")
    opts = {impl: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
            for impl, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    losses: dict[str, list[float]] = {impl: [] for impl in models}
    counts = {}
    for step in range(STEPS):
        x = torch.randn(4 * world_size, DIM, generator=gen).chunk(world_size)[rank]
        for impl, model in models.items():
            model.skip = 5 if case == "leaves_order" and step == 1 else None
            profile = impl == "flatshard" and step == STEPS - 1
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else \
                    _nothing() as prof:
                _C.reset_peak_unsharded_bytes()
                loss = model(x).square().mean()
                forward_peak = _C.peak_unsharded_bytes()
                loss.backward()
            if profile:
                events = prof.events()
                counts = {"all_gather": _scopes(events, "flatshard::all_gather"),
                          "reduce_scatter": _scopes(events, "flatshard::reduce_scatter")}
            opts[impl].step()
            opts[impl].zero_grad()
            losses[impl].append(loss.item())
        assert _C.unsharded_bytes() == 0, f"step {step}: {_C.unsharded_bytes()} bytes left unsharded"
    params = {impl: [p.to_local().clone() for p in m.parameters()] for impl, m in models.items()}
    return {"losses": losses, "params": params, "counts": counts, "forward_peak": forward_peak,
            "planned_forward": _planned_forward(world_size, case)}


def _planned_forward(world_size: int, case: str) -> int:
    """flatshard.plan's unsharded bytes at the worst point of forward, for the same wrapping (blocks, then the root)."""
    import flatshard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if case != "plain" and case != "one_per_unit":
        return -1
    os.environ["FLATSHARD_GATHER_TOGETHER_BYTES"] = "0" if case == "one_per_unit" else str(256 * 1024)
    try:
        planned = flatshard.plan(_Stack(), world_size, api="fully_shard", auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                                 device="cpu", backend="gloo")
    finally:
        os.environ.pop("FLATSHARD_GATHER_TOGETHER_BYTES")
    return planned.memory.forward_in_flight


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_RUNS = CaseRun(_case, lambda world_size: (world_size, [(c, c) for c in CASES]))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_gathered_together_as_torch_fsdp2(world_size, case):
    for out in _RUNS.results(world_size, case):
        assert out["losses"]["flatshard"] == out["losses"]["torch"]
        for mine, theirs in zip(out["params"]["flatshard"], out["params"]["torch"]):
            assert torch.equal(mine, theirs)
    out = _RUNS.results(world_size, case)[0]
    if case.startswith("unit_without_parameters"):
        return
    if out["planned_forward"] >= 0:
        # flatshard.plan's forward against flatshard's own counter of unsharded bytes: equal at W = 2; at W = 4 the
        # plan also holds gloo's flat copy of the prefetched unit's output (one unit, 288 bytes), which the counter
        # leaves out, where that is the worst point (one unit at a time).
        extra = 288 if world_size == 4 and case == "one_per_unit" else 0
        assert out["planned_forward"] == out["forward_peak"] + extra, (out["planned_forward"], out["forward_peak"])
    units = N_BLOCKS + 1
    gathered, reduced = out["counts"]["all_gather"], out["counts"]["reduce_scatter"]
    trainable = units - (case == "mixed")
    if case == "one_per_unit":
        # Forward: every block (the root keeps its parameters); backward: every block again (the root is gathered).
        assert gathered == 2 * N_BLOCKS + 1 and reduced == trainable
    else:
        # A few groups each way; bf16's block 4 and the frozen block 7 break them up in `mixed` (block 4's gradient is
        # reduced in bf16: alone, between two groups), and in `leaves_order` the profiled step follows the order
        # learned in the step that skipped block 5, so its forward leaves that order at block 5.
        assert gathered <= {"plain": 4, "mixed": 10, "leaves_order": 12}[case], out["counts"]
        assert reduced == (trainable if world_size == 4 else 3 if case == "mixed" else 1), out["counts"]


def test_gather_together_bytes_from_the_environment(monkeypatch):
    from flatshard._fsdp2_config import GATHER_TOGETHER_BYTES, gather_together_bytes

    monkeypatch.delenv("FLATSHARD_GATHER_TOGETHER_BYTES", raising=False)
    assert gather_together_bytes() == GATHER_TOGETHER_BYTES
    assert gather_together_bytes("cuda") == 0  # (until NCCL's grouped all-gather has run on a GPU)
    monkeypatch.setenv("FLATSHARD_GATHER_TOGETHER_BYTES", "0")
    assert gather_together_bytes() == 0
    monkeypatch.setenv("FLATSHARD_GATHER_TOGETHER_BYTES", "65536")
    assert gather_together_bytes("cuda") == 65536
    for bad in ("-1", "lots"):
        monkeypatch.setenv("FLATSHARD_GATHER_TOGETHER_BYTES", bad)
        with pytest.raises(ValueError, match=r"FLATSHARD_GATHER_TOGETHER_BYTES=.*expected a number of bytes"):
            gather_together_bytes()
