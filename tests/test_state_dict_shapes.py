"""State dicts on every model shape: units that hold parameters directly, leaf units, plain
parents, nested units, padding; FULL, SHARDED and LOCAL; both settings of use_orig_params.

The round trip (W = 1, 2, 4): train one Adam step, save the model's and the optimizer's
state dicts (``state_dict`` and ``FSDP.optim_state_dict`` under one state-dict type), load
both into a freshly wrapped model of another init (``load_state_dict`` with strict=True and
``optim_state_dict_to_load``), train one more step in both: the losses and every full
parameter must be those of the original continued, bit for bit (same world size, same
arithmetic).

torch FSDP1 interchange (W = 2): a FULL state dict and a SHARDED checkpoint (through
``torch.distributed.checkpoint``) written by torch's FSDP1 load into flatshard with
strict=True, and the reverse, giving the writer's values exactly.

strict=False (W = 2): a state dict with one entry removed and one added reports the same
``missing_keys`` / ``unexpected_keys`` as torch's FSDP1 (FULL, SHARDED), clean names; under
LOCAL (where torch's FSDP1 raises) the removed flat parameter's key.
"""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _cases import CaseRun, scratch_dir
from models import SHAPES, build_shape, fsdp_class

TYPES = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]


def _wrap(impl: str, shape: str, seed: int, use_orig_params: bool):
    FSDP = fsdp_class(impl)
    model = FSDP(build_shape(shape, seed), auto_wrap_policy=ModuleWrapPolicy(set(SHAPES[shape][1])),
                 device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    return FSDP, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt, rank: int, step: int) -> float:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(FSDP, model) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- round trip


def _round_trip(rank, world_size, case):
    shape, kind, use_orig_params = case
    warnings.filterwarnings("ignore")
    sd_type = StateDictType[kind]
    FSDP, original, opt = _wrap("flatshard", shape, 0, use_orig_params)
    _step(original, opt, rank, 0)
    with FSDP.state_dict_type(original, sd_type):
        model_sd = original.state_dict()
        optim_sd = FSDP.optim_state_dict(original, opt)

    _, fresh, fresh_opt = _wrap("flatshard", shape, 1, use_orig_params)
    assert any(not torch.equal(a, b) for a, b in zip(_full(FSDP, fresh).values(), _full(FSDP, original).values()))
    with FSDP.state_dict_type(fresh, sd_type):
        result = fresh.load_state_dict(model_sd)
        fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, optim_sd))
    assert not result.missing_keys and not result.unexpected_keys, result

    assert _step(fresh, fresh_opt, rank, 1) == _step(original, opt, rank, 1), "the loss after loading differs"
    want, got = _full(FSDP, original), _full(FSDP, fresh)
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"'{name}' after one more step")


def _round_trip_cases(world_size: int):
    shapes = [s for s in SHAPES if s != "padded" or world_size > 1]
    cases = itertools.product(shapes, TYPES, (False, True))
    return world_size, [(f"{s}-{k.split('_')[0].lower()}-orig{int(u)}", (s, k, u)) for s, k, u in cases]


ROUND_TRIPS = CaseRun(_round_trip, _round_trip_cases, timeout=300.0)


@pytest.mark.parametrize("world_size,name", [
    pytest.param(w, n, id=f"W{w}-{n}") for w in (1, 2, 4) for n, _ in _round_trip_cases(w)[1]])
def test_round_trip_continues_as_the_original(world_size, name):
    ROUND_TRIPS.results(world_size, name)


# -------------------------------------------------------- torch interchange


def _values(FSDP, model) -> dict[str, torch.Tensor]:
    """The model's full parameters and buffers by clean name (FULL state dict, rank 0's view)."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _interchange(rank, world_size, case, path_root):
    shape, kind, use_orig_params, writer = case
    warnings.filterwarnings("ignore")
    reader = "flatshard" if writer == "torch" else "torch"
    W, written, opt = _wrap(writer, shape, 0, use_orig_params)
    _step(written, opt, rank, 0)
    R, loaded, _ = _wrap(reader, shape, 1, use_orig_params)
    sd_type = StateDictType[kind]
    if kind == "FULL_STATE_DICT":
        with W.state_dict_type(written, sd_type):
            state = written.state_dict()
        with R.state_dict_type(loaded, sd_type):
            result = loaded.load_state_dict(state, strict=True)
    else:
        path = os.path.join(path_root, f"{shape}-{use_orig_params}-{writer}")
        with W.state_dict_type(written, sd_type):
            saved = written.state_dict()
            dcp.save(saved, checkpoint_id=path)
        with R.state_dict_type(loaded, sd_type):
            state = loaded.state_dict()
            assert list(state) == list(saved), f"SHARDED keys: {reader} {list(state)} != {writer} {list(saved)}"
            dcp.load(state, checkpoint_id=path)
            result = loaded.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    want, got = _values(W, written), _values(R, loaded)
    assert list(got) == list(want), f"keys {list(got)} != {list(want)}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"'{name}' as {reader} loaded it")


def _interchange_cases(world_size: int):
    cases = itertools.product(SHAPES, ("FULL_STATE_DICT", "SHARDED_STATE_DICT"), (False, True), ("torch", "flatshard"))
    return world_size, [(f"{s}-{k.split('_')[0].lower()}-orig{int(u)}-from_{w}", (s, k, u, w))
                        for s, k, u, w in cases]


_CHECKPOINTS = scratch_dir("flatshard-interchange-")
INTERCHANGE = CaseRun(_interchange, _interchange_cases, _CHECKPOINTS, timeout=300.0)


@pytest.mark.parametrize("name", [n for n, _ in _interchange_cases(2)[1]])
def test_torch_fsdp1_checkpoints_interchange(name):
    INTERCHANGE.results(2, name)


# ------------------------------------------------- resuming through DCP, small parameters


def _dcp_resume(rank, world_size, case, path_root):
    """flatshard.checkpoint's get_state_dict -> torch.distributed.checkpoint.save, then load into a fresh
    model and optimizer and set_state_dict: one more step equals the original's, bit for bit. The padded
    model has parameters with fewer rows than ranks (a [1, 3] token; a 3-element one at W=4), whose ranks
    past the last chunk hold none of them."""
    shape, use_orig_params = case
    warnings.filterwarnings("ignore")
    from flatshard.checkpoint import get_state_dict, set_state_dict

    FSDP, original, opt = _wrap("flatshard", shape, 0, use_orig_params)
    _step(original, opt, rank, 0)
    path = os.path.join(path_root, f"dcp-{world_size}-{shape}-{use_orig_params}")
    model_sd, optim_sd = get_state_dict(original, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _, fresh, fresh_opt = _wrap("flatshard", shape, 1, use_orig_params)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert _step(fresh, fresh_opt, rank, 1) == _step(original, opt, rank, 1), "the loss after resuming differs"
    want, got = _full(FSDP, original), _full(FSDP, fresh)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"'{name}' after one more step")


DCP_RESUME = CaseRun(_dcp_resume, lambda w: (w, [(f"{s}-orig{int(u)}", (s, u)) for s in ("padded", "checkpointed")
                                                 for u in (False, True)]), _CHECKPOINTS, timeout=120.0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", [f"{s}-orig{int(u)}" for s in ("padded", "checkpointed") for u in (False, True)])
def test_dcp_resume_with_small_parameters(world_size, name):
    DCP_RESUME.results(world_size, name)


# --------------------------------------------------------------- strict=False


def _incompatible_keys(rank, world_size, case):
    kind, use_orig_params, impl = case
    warnings.filterwarnings("ignore")
    FSDP, model, _ = _wrap(impl, "plain_parent", 0, use_orig_params)
    with FSDP.state_dict_type(model, StateDictType[kind]):
        state = model.state_dict()
        removed = "body.inner.lin._flat_param" if kind == "LOCAL_STATE_DICT" else "body.inner.lin.weight"
        assert removed in state, list(state)
        del state[removed]
        state["body.extra"] = torch.zeros(1)
        try:
            result = model.load_state_dict(state, strict=False)
        except Exception as e:  # noqa: BLE001 - compared with the other implementation
            return f"{type(e).__name__}"
    return sorted(result.missing_keys), sorted(result.unexpected_keys)


def _incompatible_cases(world_size: int):
    cases = itertools.product(TYPES, (False, True), ("torch", "flatshard"))
    return world_size, [(f"{k.split('_')[0].lower()}-orig{int(u)}-{i}", (k, u, i)) for k, u, i in cases]


INCOMPATIBLE = CaseRun(_incompatible_keys, _incompatible_cases, timeout=120.0)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_strict_false_reports_keys_as_torch(kind, use_orig_params):
    tag = f"{kind.split('_')[0].lower()}-orig{int(use_orig_params)}"
    ours = INCOMPATIBLE.results(2, f"{tag}-flatshard")[0]
    if kind == "LOCAL_STATE_DICT":  # torch's FSDP1 raises ("No `FlatParameter` in `state_dict`"): ours reports it
        assert INCOMPATIBLE.results(2, f"{tag}-torch")[0] == "AssertionError"
        assert ours == (["body.inner.lin._flat_param"], ["body.extra"]), ours
        return
    theirs = INCOMPATIBLE.results(2, f"{tag}-torch")[0]
    assert ours == theirs == (["body.inner.lin.weight"], ["body.extra"]), (ours, theirs)
