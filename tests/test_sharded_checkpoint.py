"""Sharded checkpoints: SHARDED and LOCAL state dicts through torch.distributed.checkpoint (DCP),
flatshard.checkpoint's get/set_state_dict, resharding to other world sizes, and torch FSDP1 interop.

The oracle for resuming is the uninterrupted run: train K steps, save, build a fresh
model and optimizer, load, train the remaining steps; the losses must be those of a
run that never stopped (bit for bit at the same world size; within the parity
tolerance of tests/test_parity.py at another world size, whose reductions add in
another order). Each rank trains on its rows of the same global batch per step.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import (
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from flatshard.testing import run_distributed
from models import ATOL, RTOL, Block, fsdp_class, make_gpt, train_gpt

STEPS, SAVE_AT = 6, 3


def _build(impl: str = "flatshard", strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, seed: int = 0):
    FSDP = fsdp_class(impl)
    model = FSDP(make_gpt(seed=seed), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 sharding_strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return FSDP, model, opt


def _train(model, opt, steps: range, rank: int, world_size: int) -> list[float]:
    return train_gpt(model, opt, steps, rank, world_size)


def _uninterrupted(rank, world_size, strategy=ShardingStrategy.FULL_SHARD):
    _, model, opt = _build(strategy=strategy)
    return _train(model, opt, range(STEPS), rank, world_size)


# The ways scripts checkpoint: each saves after SAVE_AT steps into `path` and loads into a
# fresh (differently initialised) model and optimizer.

def _save_sharded(FSDP, model, opt, path):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}, checkpoint_id=path)


def _load_sharded(FSDP, model, opt, path):
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        # torch's recipe: the optimizer's state read against the model's sharded layout.
        saved = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optim",
                                                  storage_reader=dcp.FileSystemReader(path))
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, saved["optim"]))


def _save_dsd(FSDP, model, opt, path):
    from flatshard.checkpoint import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load_dsd(FSDP, model, opt, path):
    from flatshard.checkpoint import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save_local(FSDP, model, opt, path):
    # LOCAL model state through DCP, and each rank's own optimizer state (its flat shards) with torch.save.
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    torch.save(opt.state_dict(), os.path.join(path, f"optim_rank{dist.get_rank()}.pt"))


def _load_local(FSDP, model, opt, path):
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    opt.load_state_dict(torch.load(os.path.join(path, f"optim_rank{dist.get_rank()}.pt")))


WAYS = {"sharded": (_save_sharded, _load_sharded), "get_set_state_dict": (_save_dsd, _load_dsd),
        "local": (_save_local, _load_local)}


def _save_run(rank, world_size, way, path, strategy=ShardingStrategy.FULL_SHARD):
    FSDP, model, opt = _build(strategy=strategy)
    losses = _train(model, opt, range(SAVE_AT), rank, world_size)
    WAYS[way][0](FSDP, model, opt, path)
    return losses


def _resume_run(rank, world_size, way, path, strategy=ShardingStrategy.FULL_SHARD):
    FSDP, model, opt = _build(strategy=strategy, seed=7)  # other weights: the checkpoint must replace them
    WAYS[way][1](FSDP, model, opt, path)
    return _train(model, opt, range(SAVE_AT, STEPS), rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("way", list(WAYS))
def test_resume_matches_uninterrupted_run(way, world_size, tmp_path):
    path = str(tmp_path / "ckpt")
    reference = run_distributed(_uninterrupted, world_size, timeout=120)[0]
    before = run_distributed(_save_run, world_size, way, path, timeout=120)[0]
    after = run_distributed(_resume_run, world_size, way, path, timeout=120)[0]
    assert before + after == reference, f"{way} at W={world_size}: resumed {before + after} != {reference}"


@pytest.mark.parametrize(
    "saved_at, loaded_at, saved_strategy",
    [(4, 2, ShardingStrategy.FULL_SHARD), (4, 1, ShardingStrategy.FULL_SHARD),
     (4, 2, ShardingStrategy.HYBRID_SHARD), (2, 4, ShardingStrategy.SHARD_GRAD_OP)],
    ids=["4to2", "4to1", "hybrid2x2to2", "2to4"],
)
@pytest.mark.parametrize("way", ["sharded", "get_set_state_dict"])
def test_reshard_to_another_world_size(way, saved_at, loaded_at, saved_strategy, tmp_path):
    path = str(tmp_path / "ckpt")
    before = run_distributed(_save_run, saved_at, way, path, saved_strategy, timeout=120)[0]
    after = run_distributed(_resume_run, loaded_at, way, path, timeout=120)[0]
    reference = run_distributed(_uninterrupted, loaded_at, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(before + after), torch.tensor(reference), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"saved at W={saved_at} ({saved_strategy.name}), resumed at "
                                             f"W={loaded_at}: {m}")


def _load_other_layout(rank, world_size, path):
    FSDP = fsdp_class("flatshard")
    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        # The root unit's record (in the dict's _metadata, see [Note: Local state dicts]) names embed.weight first; as
        # if the model had changed since.
        record = state["model"]._metadata[""]["flatshard_layout"]
        state["model"]._metadata[""]["flatshard_layout"] = dict(record, names=list(reversed(record["names"])))
        assert not any(key.endswith("_flat_param_layout") for key in state["model"])  # (torch's keys only)
        with pytest.raises(ValueError, match=r"LOCAL_STATE_DICT for unit '<root>' was saved with another "
                                             r"layout \(names: .*SHARDED_STATE_DICT"):
            model.load_state_dict(state["model"])


def test_local_state_dict_refuses_another_wrapping(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_run, 2, "local", path, timeout=120)
    run_distributed(_load_other_layout, 2, path, timeout=60)


def _held_and_saved(rank, world_size, path):
    """What this rank holds (each ShardedTensor's or DTensor's local chunk and its offset; every plain value),
    and the save."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    from flatshard.checkpoint import get_state_dict

    FSDP, model, opt = _build()
    _train(model, opt, range(2), rank, world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=path)
    held = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                held[prefix] = ("chunk", tuple(value.size()), tuple(shard.metadata.shard_offsets),
                                shard.tensor.clone())
        elif isinstance(value, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            held[prefix] = ("chunk", tuple(value.shape), tuple(offset), value.to_local().clone())
        elif isinstance(value, torch.Tensor):
            held[prefix] = ("plain", tuple(value.shape), (), value.clone())

    walk("model", model_sd)
    for name, per_param in optim_sd["state"].items():
        for key, value in per_param.items():
            walk(f"optim.state.{name}.{key}", value)
    return held


@pytest.mark.parametrize("world_size", [2, 4])
def test_dcp_checkpoint_holds_every_rank_data(world_size, tmp_path):
    """Every entry read back from the checkpoint equals what each rank held: nothing lost, nothing
    from the wrong rank."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "ckpt")
    held = run_distributed(_held_and_saved, world_size, path, timeout=120)
    dcp_to_torch_save(path, str(tmp_path / "all.pt"))
    saved = torch.load(str(tmp_path / "all.pt"), weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", saved)
    names = set(held[0])
    assert all(set(h) == names for h in held), "ranks hold different entries"
    assert set(flat) >= names, f"lost from the checkpoint: {sorted(names - set(flat))}"
    # Per-element optimizer state and every parameter: one chunk per rank, together the whole tensor.
    chunked = [n for n in names if held[0][n][0] == "chunk"]
    assert any(".exp_avg" in n for n in chunked) and any(n.startswith("model.") for n in chunked)
    for name in sorted(names):
        whole = flat[name]
        covered = torch.zeros(whole.shape, dtype=torch.bool)
        for rank, h in enumerate(held):
            kind, shape, offset, local = h[name]
            assert tuple(whole.shape) == shape, name
            if kind == "plain":
                assert torch.equal(whole, local), f"{name}: rank {rank}'s value is not the saved one"
                covered[...] = True
                continue
            index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            assert torch.equal(whole[index], local), f"{name}: rank {rank}'s chunk at {offset} is not the saved one"
            covered[index] = True
        assert covered.all(), f"{name}: elements no rank holds"


def _torch_helpers(rank, world_size):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    _, model, opt = _build()
    _train(model, opt, range(1), rank, world_size)
    for call in (lambda: get_state_dict(model, opt), lambda: get_model_state_dict(model),
                 lambda: set_state_dict(model, opt, model_state_dict={}, optim_state_dict={})):
        with pytest.raises(RuntimeError, match=r"recognise only torch's own FSDP classes.*"
                                               r"from flatshard.checkpoint import get_state_dict.*"
                                               r"set FLATSHARD_AS_TORCH_FSDP=1 in its environment"):
            call()


def test_torch_state_dict_helpers_refuse_flatshard_models():
    """torch's get_state_dict would keep one rank's optimizer shards; on a flatshard model it raises
    with the fix instead of writing such a checkpoint."""
    run_distributed(_torch_helpers, 2, timeout=60)


def _torch_interop_save(rank, world_size, impl, path):
    FSDP, model, opt = _build(impl)
    losses = _train(model, opt, range(SAVE_AT), rank, world_size)
    _save_sharded(FSDP, model, opt, path)
    return losses


def _torch_interop_resume(rank, world_size, impl, path):
    FSDP, model, opt = _build(impl, seed=7)
    _load_sharded(FSDP, model, opt, path)
    return _train(model, opt, range(SAVE_AT, STEPS), rank, world_size)


@pytest.mark.parametrize("saver, loader", [("torch", "flatshard"), ("flatshard", "torch")])
def test_sharded_checkpoint_interchangeable_with_torch_fsdp1(saver, loader, tmp_path):
    """A SHARDED_STATE_DICT checkpoint (model and optimizer) written by one loads into the other at
    W=2 and training goes on as the saver's would have (within the parity tolerance)."""
    path = str(tmp_path / "ckpt")
    before = run_distributed(_torch_interop_save, 2, saver, path, timeout=120)[0]
    after = run_distributed(_torch_interop_resume, 2, loader, path, timeout=120)[0]
    reference = run_distributed(_torch_interop_resume, 2, saver, path, timeout=120)[0]
    assert len(before) == SAVE_AT
    torch.testing.assert_close(torch.tensor(after), torch.tensor(reference), rtol=RTOL, atol=ATOL)


def _older_sharded_pair(rank, world_size):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from flatshard._sharded_state_dict import to_full

    FSDP, model, opt = _build()
    _train(model, opt, range(2), rank, world_size)
    sharded = FSDP.sharded_optim_state_dict(model, opt)
    moments = [v for per_param in sharded["state"].values() for k, v in per_param.items() if k == "exp_avg"]
    assert moments and all(isinstance(v, ShardedTensor) for v in moments)  # as torch's, without a device_mesh
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = FSDP.optim_state_dict(model, opt)
    for name, per_param in sharded["state"].items():  # the same values as the FULL dict
        torch.testing.assert_close(to_full({0: per_param["exp_avg"]})[0], full["state"][name]["exp_avg"].to(
            per_param["exp_avg"].dtype), rtol=0, atol=0)
    before = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
              for k, v in opt.state_dict()["state"].items()}
    flattened = FSDP.flatten_sharded_optim_state_dict(sharded, model, opt)
    for index, values in before.items():  # back to exactly this rank's flat-shard state
        for key, value in values.items():
            assert torch.equal(flattened["state"][index][key], value), (index, key)


def test_older_sharded_optim_state_dict_functions():
    """torch's sharded_optim_state_dict / flatten_sharded_optim_state_dict round-trip each rank's state."""
    run_distributed(_older_sharded_pair, 2, timeout=60)


SETTINGS = {
    "NO_SHARD": {"sharding_strategy": ShardingStrategy.NO_SHARD},
    "use_orig_params": {"use_orig_params": True},
    "bf16": {"mixed_precision": "bf16"},
    "cpu_offload": {"cpu_offload": "offload"},
}


def _round_trip(rank, world_size, setting, kind, path):
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    from flatshard.checkpoint import get_state_dict, set_state_dict

    kwargs = dict(SETTINGS[setting])
    if kwargs.get("mixed_precision"):
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if kwargs.get("cpu_offload"):
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    FSDP = fsdp_class("flatshard")

    def build(seed):
        model = FSDP(make_gpt(seed=seed), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                     **kwargs)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def weights(model):
        with FSDP.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    saved, saved_opt = build(0)
    _train(saved, saved_opt, range(2), rank, world_size)
    loaded, loaded_opt = build(5)
    if kind == "get_set_state_dict":
        model_sd, optim_sd = get_state_dict(saved, saved_opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        model_sd, optim_sd = get_state_dict(loaded, loaded_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(loaded, loaded_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        with FSDP.state_dict_type(saved, StateDictType.LOCAL_STATE_DICT):
            dcp.save({"model": saved.state_dict()}, checkpoint_id=path)
        with FSDP.state_dict_type(loaded, StateDictType.LOCAL_STATE_DICT):
            state = {"model": loaded.state_dict()}
            dcp.load(state, checkpoint_id=path)
            loaded.load_state_dict(state["model"])
        # LOCAL: each rank keeps its own optimizer state (copied: load_state_dict would share its tensors).
        loaded_opt.load_state_dict(copy.deepcopy(saved_opt.state_dict()))
    want, got = weights(saved), weights(loaded)
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    # One more step each: the optimizer state came along too.
    _train(saved, saved_opt, range(2, 3), rank, world_size)
    _train(loaded, loaded_opt, range(2, 3), rank, world_size)
    want, got = weights(saved), weights(loaded)
    assert [n for n in want if not torch.equal(want[n], got[n])] == []


@pytest.mark.parametrize("kind", ["get_set_state_dict", "local"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_round_trip_under_other_settings(setting, kind, tmp_path):
    run_distributed(_round_trip, 2, setting, kind, str(tmp_path / "ckpt"), timeout=120)


def _load_peak(rank, world_size, kind):
    from flatshard import _C

    FSDP = fsdp_class("flatshard")
    saved = FSDP(make_gpt(n_layers=4), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    loaded = FSDP(make_gpt(n_layers=4, seed=3), auto_wrap_policy=ModuleWrapPolicy({Block}),
                  device_id=torch.device("cpu"))
    units = [u for u in FSDP.fsdp_modules(loaded) if u._unit_state.handle is not None]
    largest = max(u._unit_state.handle.layout.padded_numel * 4 for u in units)
    whole = sum(u._unit_state.handle.layout.padded_numel * 4 for u in units)
    with FSDP.state_dict_type(saved, kind):
        state = saved.state_dict()
    _C.reset_peak_unsharded_bytes()
    with FSDP.state_dict_type(loaded, kind):
        result = loaded.load_state_dict(state)
    peak = _C.peak_unsharded_bytes()
    assert not result.missing_keys and not result.unexpected_keys, result
    assert peak <= largest < whole, (peak, largest, whole)  # one unit at a time, not the model
    with FSDP.summon_full_params(saved), FSDP.summon_full_params(loaded):
        for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
            assert torch.equal(a, b), name
    # A key missing from the state dict is reported (strict), as torch's nn.Module does.
    del state["blocks.1.mlp.fc.weight"]
    with FSDP.state_dict_type(loaded, kind):
        with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"blocks.1.mlp.fc.weight\""):
            loaded.load_state_dict(state)
        assert loaded.load_state_dict(state, strict=False).missing_keys == ["blocks.1.mlp.fc.weight"]


@pytest.mark.parametrize("kind", [StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT],
                         ids=["sharded", "full"])
def test_load_gathers_one_unit_at_a_time(kind):
    """SHARDED and FULL loads summon one unit at a time (as torch FSDP1), never the whole model."""
    run_distributed(_load_peak, 2, kind, timeout=60)


def _full_from_rank0(rank, world_size):
    from flatshard.checkpoint import StateDictOptions, get_state_dict, set_state_dict

    FSDP, saved, saved_opt = _build()
    _train(saved, saved_opt, range(2), rank, world_size)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(saved, saved_opt, options=options)
    assert (rank == 0) == bool(model_sd) and (rank == 0) == bool(optim_sd)  # rank 0 only, as torch
    _, loaded, loaded_opt = _build(seed=7)
    set_state_dict(loaded, loaded_opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _train(saved, saved_opt, range(2, 3), rank, world_size)
    _train(loaded, loaded_opt, range(2, 3), rank, world_size)
    with FSDP.summon_full_params(saved), FSDP.summon_full_params(loaded):
        for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
            assert torch.equal(a, b), name


def test_full_state_dict_broadcast_from_rank0():
    """StateDictOptions(full_state_dict=True, cpu_offload=True) on save (rank 0 holds it) and
    broadcast_from_rank0=True on load: the other ranks get it tensor by tensor and train on the same."""
    run_distributed(_full_from_rank0, 2, timeout=60)
