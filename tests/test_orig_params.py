"""``use_orig_params=True``: the same script as with torch's FSDP1, original parameters and names.

Acceptance (issue 9): with ``use_orig_params=True`` a script that builds optimizer groups by
name (AdamW, no weight decay for biases and norms) trains to the same per-step losses and
final parameters as torch's FSDP1 with ``use_orig_params=True`` at W = 1, 2, 4 and for
FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, with ``no_sync()`` accumulation too; the
parameters, their shapes between iterations (this rank's 1-D piece, possibly empty, or the
whole parameter at shard factor 1), their ``.grad`` and the optimizer state dict match
torch's (a LoRA unit's pieces excepted: flatshard lays its trainable parameters out first, see
[Note: Trainable prefix] in csrc/flatshard/flat_param.h, so each rank holds other pieces); a
LoRA-shaped unit (frozen base, trainable adapters) trains as torch's does, bit for bit; values
changed between iterations (in place or by replacing ``.data``) and gradients set to None
are honoured.

Oracles: torch's FSDP1 (same script, ``use_orig_params=True``): losses and parameters bit-equal
(both run the same per-element arithmetic on the same gathered values), and a single-process
run of the unwrapped model on the global batch, with the same edits (rtol 1e-5 / atol 1e-6,
see [Note: fp32 Adam parity margin] in models.py). The optimizer state dict is checked
against the single-process optimizer's state only: torch's FSDP1 (2.13) returns ``exp_avg``
equal to ``exp_avg_sq`` for these parameters. Where torch's FSDP1 itself goes wrong, the
single-process run is the only oracle: replacing a parameter's ``.data`` between iterations
(torch's losses then differ from the unwrapped model's), a LoRA model at world size 1
(torch raises "as_params=True type(prim_param)=Tensor") and a second backward through a kept
graph after a zero_grad (torch's leaves every ``.grad`` None).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _cases import CaseRun
from flatshard.testing import run_distributed
from models import ATOL, RTOL, Block, fsdp_class, gpt_loss, local_slice, make_batch, make_gpt

STEPS = 4
PG_TIMEOUT_S = 30.0


def _cfg(strategy="FULL_SHARD", *, accum=None, model="gpt", edit=None, torch_oracle=True):
    name = "-".join([model, strategy.lower()] + ([accum] if accum else []) + ([edit] if edit else []))
    return dict(name=name, strategy=strategy, accum=accum, model=model, edit=edit,
                torch_oracle=torch_oracle and edit != "data")


CONFIGS = {
    1: [_cfg(), _cfg(model="lora", torch_oracle=False), _cfg(edit="data")],
    2: [_cfg(), _cfg("SHARD_GRAD_OP"), _cfg("NO_SHARD"), _cfg(accum="no_sync"), _cfg(model="lora"),
        _cfg("SHARD_GRAD_OP", model="lora"), _cfg(edit="data"), _cfg(edit="grad_none"),
        _cfg(edit="backward_again", torch_oracle=False), _cfg(edit="zero_grad_after_forward")],
    4: [_cfg(), _cfg("NO_SHARD", model="lora", torch_oracle=False), _cfg(accum="no_sync"), _cfg(edit="data")],
}


class LoRALinear(nn.Module):
    """A frozen base Linear with a trainable low-rank adapter, in one module (one unit)."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def build(model: str) -> nn.Module:
    m = make_gpt()
    if model == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            for block in m.blocks:
                block.attn.qkv = LoRALinear(block.attn.qkv)
                block.mlp.fc = LoRALinear(block.mlp.fc)
        for name, p in m.named_parameters():
            if "blocks" not in name:
                p.requires_grad_(False)
    return m


def _groups(model: nn.Module) -> list[dict]:
    """AdamW groups by name, as HF scripts build them: no weight decay for biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module = name.split(".")[-2] if "." in name else ""
        (no_decay if name.endswith("bias") or module.startswith("ln") else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _train(rank, world_size, impl, cfg) -> dict:
    """``impl``: "torch", "flatshard", or "local" (the unwrapped model on the global batch)."""
    from torch.distributed.fsdp import ShardingStrategy

    if impl == "local":
        rank, world_size = 0, 1
        model = build(cfg["model"])
    else:
        FSDP = fsdp_class(impl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FSDP(build(cfg["model"]), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                         device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy[cfg["strategy"]])
    names = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    local = local_slice(make_batch(), rank, world_size)
    micro = [local_slice(local, j, 2) for j in range(2)]
    losses, grad_shapes = [], None
    for step in range(STEPS):
        if cfg["accum"] == "no_sync" and impl != "local":
            with model.no_sync():
                first = gpt_loss(model, *micro[0]) / 2
                first.backward()
            second = gpt_loss(model, *micro[1]) / 2
            second.backward()
            loss = first.detach() + second.detach()
        else:
            loss = gpt_loss(model, *local)
            if cfg["edit"] == "zero_grad_after_forward" and step >= 1:
                opt.zero_grad()  # (the scripts that zero gradients after the forward: the last step's are kept till here)
            if cfg["edit"] == "backward_again" and step == 1:
                # The step's gradients from a second backward through the kept graph, after a zero_grad: none of the
                # first's may remain (torch's FSDP1 leaves every .grad None then: the unwrapped model is the oracle)
                loss.backward(retain_graph=True)
                opt.zero_grad()
            loss.backward()
        if grad_shapes is None:
            grad_shapes = [(n, None if p.grad is None else tuple(p.grad.shape)) for n, p in model.named_parameters()]
        if cfg["edit"] == "grad_none" and step == 1:
            # A script dropping some gradients before the step (e.g. a frozen-for-now group).
            for n, p in model.named_parameters():
                if "blocks.1" in n:
                    p.grad = None
        opt.step()
        if cfg["edit"] != "zero_grad_after_forward":
            opt.zero_grad()
        if cfg["edit"] == "data" and step == 1:
            with torch.no_grad():  # between iterations: in place on one, replacing .data on another
                for n, p in model.named_parameters():
                    n = n.replace("_fsdp_wrapped_module.", "")  # (outside summon_full_params, as torch's names)
                    if n.endswith("ln_f.weight"):
                        p.mul_(0.5)
                    if n.endswith("blocks.0.mlp.out.bias"):
                        p.data = p.data * 0 + 0.25
        losses.append(loss.detach())
    losses = torch.stack(losses)
    if impl == "local":
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        name_of = {id(p): n for n, p in model.named_parameters()}
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        osd = {"state": {name_of[id(params[i])]: v for i, v in sd["state"].items()},
               "param_groups": [{**g, "params": [name_of[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]]}
        return {"losses": losses.tolist(), "names": [(n, None, r) for n, _, r in names], "grad_shapes": None,
                "full": full, "osd": osd["state"], "osd_groups": [sorted(g["params"]) for g in osd["param_groups"]]}
    dist.all_reduce(losses)
    losses = (losses / world_size).tolist()
    with FSDP.summon_full_params(model):
        full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    osd = FSDP.optim_state_dict(model, opt)
    return {
        "losses": losses,
        "names": [(n.replace("_fsdp_wrapped_module.", ""), s, r) for n, s, r in names],
        "grad_shapes": [(n.replace("_fsdp_wrapped_module.", ""), s) for n, s in grad_shapes],
        "full": full,
        "osd": {k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
                for k, v in osd["state"].items()},
        "osd_groups": [sorted(g["params"]) for g in osd["param_groups"]],
    }


def _run_config(rank, world_size, cfg) -> dict:
    """The config trained by each implementation it is checked against: {impl: what _train returned}."""
    warnings.filterwarnings("ignore")
    impls = ("torch", "flatshard", "local") if cfg["torch_oracle"] else ("flatshard", "local")
    return {impl: _train(rank, world_size, impl, cfg) for impl in impls}


def _cases_of(world_size: int):
    return world_size, [(c["name"], c) for c in CONFIGS[world_size]]


RUNS = CaseRun(_run_config, _cases_of, timeout=300.0, pg_timeout=PG_TIMEOUT_S)


@pytest.mark.parametrize(
    "world_size,name", [pytest.param(w, c["name"], id=f"W{w}-{c['name']}") for w, cs in CONFIGS.items() for c in cs]
)
def test_same_as_torch_fsdp1_with_use_orig_params(world_size, name):
    cfg = next(c for c in CONFIGS[world_size] if c["name"] == name)
    for rank, r in enumerate(RUNS.results(world_size, name)):
        ours, local = r["flatshard"], r["local"]
        if cfg["torch_oracle"]:
            theirs = r["torch"]
            if cfg["model"] == "lora":  # trainable parameters first in the flat layout: other pieces per rank
                assert [(n, g) for n, _, g in ours["names"]] == [(n, g) for n, _, g in theirs["names"]]
            else:
                assert ours["names"] == theirs["names"], f"rank {rank}: parameters (name, shape, requires_grad) differ"
                assert ours["grad_shapes"] == theirs["grad_shapes"], f"rank {rank}: .grad shapes differ"
            assert ours["losses"] == theirs["losses"], f"rank {rank}: losses {ours['losses']} vs {theirs['losses']}"
            for n, v in theirs["full"].items():
                torch.testing.assert_close(ours["full"][n], v, rtol=0, atol=0, msg=f"rank {rank}: '{n}'")
        assert [(n, g) for n, _, g in ours["names"]] == [(n, g) for n, _, g in local["names"]]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(local["losses"]), rtol=RTOL, atol=ATOL,
                                   msg=f"rank {rank}: losses against the unwrapped model")
        assert sorted(ours["full"]) == sorted(local["full"])
        for n, v in local["full"].items():
            torch.testing.assert_close(ours["full"][n], v, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: '{n}'")
        assert ours["osd_groups"] == local["osd_groups"]
        assert sorted(ours["osd"]) == sorted(local["osd"]), f"rank {rank}: optimizer state names differ"
        for n, state in local["osd"].items():
            assert sorted(ours["osd"][n]) == sorted(state), f"rank {rank}: {n}: keys {sorted(ours['osd'][n])}"
            for k, v in state.items():
                got, want = torch.as_tensor(ours["osd"][n][k]), torch.as_tensor(v)
                assert got.shape == want.shape, f"rank {rank}: optimizer state {n}.{k}: {got.shape} vs {want.shape}"
                worst = (got.double() - want.double()).abs().max().item()
                assert worst <= 1e-6 + 1e-4 * want.abs().max().item(), f"rank {rank}: optimizer state {n}.{k} off by {worst}"


def _lora_reduction_bytes(rank, world_size, prefix: bool) -> dict:
    """One LoRA step under the profiler: the bytes the collectives reduced, and the units' trainable bytes."""
    import json
    import os
    import tempfile

    from torch.profiler import profile

    from flatshard import FullyShardedDataParallel as FSDP

    model = FSDP(build("lora"), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 use_orig_params=True)
    units = [u for u in FSDP.fsdp_modules(model) if u._unit_state.handle is not None]
    if not prefix:  # the whole flat gradient, as torch's FSDP1 reduces it
        for u in units:
            u._unit_state.handle.set_reduce_prefix(-1)
    trainable = sum(4 * sum(n for i, n in enumerate(u._unit_state.handle.layout.numels) if i not in set(u._unit_state.frozen_indices))
                    for u in units if u._flat_param.requires_grad)
    whole = sum(4 * u._unit_state.handle.layout.padded_numel for u in units if u._flat_param.requires_grad)
    tokens, targets = local_slice(make_batch(), rank, world_size)
    loss = gpt_loss(model, tokens, targets)
    with profile(record_shapes=True) as prof:
        loss.backward()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    # Two ranks' reduce-scatter is an exchange of halves, as is their all-gather (see [Note: Two gloo ranks exchange
    # halves] in csrc/flatshard/collectives.cpp), and a reduce-scatter's all-to-all counts as its whole input (the half
    # it sends, times two). gloo runs collectives on two threads, so its events may start in another order than
    # flatshard issued them: rather than pair them by time, take out one gloo event per all-gather issued (an
    # all-gather's input is the unit's shard, whatever the reduction sends), and what is left is what was reduced.
    issued = [e["name"].partition(" ")[::2] for e in events
              if e.get("name", "").split(" ")[0] in ("flatshard::all_gather", "flatshard::reduce_scatter",
                                                     "flatshard::all_reduce")]
    wire = [(e["name"], e["args"]["Input Dims"][0]) for e in events
            if e.get("name", "").startswith("gloo:") and e.get("args", {}).get("Input type")
            and e["args"]["Input type"][0] == "float"]  # (not the rank-divergence guard's int64 exchanges)
    assert len(issued) == len(wire), (issued, wire)
    shard_numel = {u._unit_state.name: u._unit_state.handle.layout.padded_numel // world_size for u in units}
    for kind, unit in issued:
        if kind == "flatshard::all_gather":
            gathered = ("gloo:all_to_all" if world_size == 2 else "gloo:all_gather", [shard_numel[unit]])
            assert gathered in wire, (unit, gathered, wire)
            wire.remove(gathered)
    reduced = sum(4 * (dims[0] if dims else 1) * (world_size if name == "gloo:all_to_all" else 1)
                  for name, dims in wire)
    return {"reduced": reduced, "trainable": trainable, "whole": whole, "units": len(units)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_lora_reduces_only_trainable_bytes(world_size):
    """Beyond torch (see [Note: Trainable prefix] in csrc/flatshard/flat_param.h): a LoRA unit reduces its
    trainable parameters' gradient bytes plus padding, not its whole flat gradient as torch's FSDP1 does."""
    got = run_distributed(_lora_reduction_bytes, world_size, True)[0]
    padding = 4 * world_size * got["units"]  # at most W - 1 elements per unit
    assert got["reduced"] <= got["trainable"] + padding, got
    assert got["reduced"] < got["whole"], got
    before = run_distributed(_lora_reduction_bytes, world_size, False)[0]  # the control: everything reduced
    assert before["reduced"] >= before["whole"] > got["reduced"], (before, got)
