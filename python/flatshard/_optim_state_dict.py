"""Optimizer state dicts: ``FSDP.optim_state_dict`` and ``FSDP.optim_state_dict_to_load``.

[Note: Optimizer state dicts]
FULL_STATE_DICT format, as torch's FSDP1 writes it: {"state": {original
parameter name: {key: value}}, "param_groups": [{..., "params": [names]}]}.
The optimizer steps the flat shards, so a state tensor shaped like a shard
(Adam's moments) is all-gathered over the shard group, its padding dropped
and split at the layout's offsets into one tensor per original parameter;
anything else (a scalar ``step``) is repeated for each. A tied parameter
appears once, under its first name. Loading is the reverse: each rank
concatenates a unit's entries in flat order, pads, and keeps its shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn


from flatshard import _rank_guard
from flatshard._broadcast import broadcast_from_rank0
from flatshard._common import check_between_iterations, clean_name, fsdp_modules, is_unit, join
from flatshard._profiling import collective_range
from flatshard._runtime import lazy_init
from flatshard._sharded_state_dict import is_sharded, to_full, to_sharded, uses_dtensor
from flatshard.api import StateDictType

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    rank0_only: bool | None = None,
    offload_to_cpu: bool | None = None,
) -> dict[str, Any]:
    """The optimizer's state under the original parameter names (see [Note: Optimizer state dicts]).

    Collective over every unit's group: every rank must call it.
    ``optim_state_dict`` defaults to ``optim.state_dict()``. The units'
    FullOptimStateDictConfig applies: ``offload_to_cpu`` (default True)
    and ``rank0_only`` (other ranks get ``{}``).
    """
    if group is not None:
        raise NotImplementedError(
            "FullyShardedDataParallel.optim_state_dict: group= is not implemented in flatshard; the "
            "units' own groups are used."
        )
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    entries, config = _optim_entries(model, optim, "optim_state_dict")
    sharded = fsdp_modules(model)[0]._unit_state.state_dict_type != StateDictType.FULL_STATE_DICT  # LOCAL: as torch, SHARDED
    rank0_only = getattr(config, "rank0_only", False) if rank0_only is None else rank0_only
    offload_to_cpu = config.offload_to_cpu if offload_to_cpu is None else offload_to_cpu
    _check_same_state_keys(entries, osd)
    keep = not rank0_only or dist.get_rank() == 0
    shape_of = _unit_param_shapes(entries) if sharded else {}
    state: dict[str, dict[str, Any]] = {}
    names_of: dict[int, list[str]] = {}
    orig_done: set[int] = set()
    for index, entry in enumerate(entries):
        values = osd["state"].get(index, {})
        names_of[index] = entry.names
        if entry.orig_index is not None:
            if id(entry.unit) in orig_done:
                continue
            orig_done.add(id(entry.unit))  # the whole unit at once, at its first parameter
            full = _unflatten_orig_state(entry.unit, [(i, e) for i, e in enumerate(entries) if e.unit is entry.unit],
                                         osd)
        else:
            full = {entry.names[0]: dict(values)} if entry.unit is None else _unflatten_state(entry, values)
        if keep:
            state.update(_kept_state(full, entry, shape_of, config, offload_to_cpu))
    if not keep:
        return {}
    groups = []
    for g in osd["param_groups"]:
        g = dict(g)
        g["params"] = [name for index in g["params"] for name in names_of[index]]
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _kept_state(full: dict[str, dict[str, Any]], entry: _OptimEntry, shape_of: dict[str, torch.Size], config: Any,
                offload_to_cpu: bool) -> dict[str, dict[str, Any]]:
    """The state a rank returns for one entry's parameters: copies (on the host with ``offload_to_cpu``), and under
    SHARDED each per-element tensor cut as its parameter is ([Note: Sharded state dicts])."""
    kept = {}
    for name, per_param in full.items():
        if not per_param:
            continue
        if name in shape_of:
            use_dtensor = uses_dtensor(entry.unit, config)
            per_param = {k: to_sharded(v, entry.unit, use_dtensor, offload_to_cpu)
                         if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shape_of[name] else v
                         for k, v in per_param.items()}
        kept[name] = {
            k: v if is_sharded(v) or not isinstance(v, torch.Tensor)
            else (v.detach().clone().cpu() if offload_to_cpu else v.detach().clone())
            for k, v in per_param.items()
        }
    return kept


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    from_rank0: bool | None = None,
    _optim_given: bool = True,
) -> dict[str, Any]:
    """Turns a state dict from ``optim_state_dict`` (ours or torch's FSDP1, FULL) into one for ``optim``.

    Each rank keeps its shard of every unit's state. With the units'
    ``rank0_only`` config only rank 0 needs to pass the dict (it is
    broadcast). ``load_directly`` also loads it into ``optim``.
    """
    if is_named_optimizer or group is not None:
        raise NotImplementedError(
            "FullyShardedDataParallel.optim_state_dict_to_load: is_named_optimizer and group= are not "
            "implemented in flatshard."
        )
    entries, config = _optim_entries(model, optim, "optim_state_dict_to_load")
    if getattr(config, "rank0_only", False) if from_rank0 is None else from_rank0:
        optim_state_dict = broadcast_from_rank0(optim_state_dict, "optim_state_dict_to_load")
    _check_loadable(optim_state_dict, entries)
    state = _state_to_load(entries, optim_state_dict["state"])
    result = {"state": state, "param_groups": _groups_to_load(optim_state_dict["param_groups"], optim, _optim_given)}
    if load_directly:
        optim.load_state_dict(result)
    return result


def _check_loadable(optim_state_dict: Any, entries: list[_OptimEntry]) -> None:
    """The dict ``optim_state_dict`` returns, with state for this model's parameters only."""
    if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
        raise ValueError(
            "FullyShardedDataParallel.optim_state_dict_to_load: expected the dict that "
            "FSDP.optim_state_dict() returns ({'state': ..., 'param_groups': ...}) but got "
            f"{type(optim_state_dict).__name__} with keys {sorted(optim_state_dict) if isinstance(optim_state_dict, dict) else '-'}"
        )
    full_state = optim_state_dict["state"]
    known = {n for entry in entries for n in entry.names}
    unknown = [k for k in full_state if k not in known]
    if unknown:
        raise ValueError(
            f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict has state for "
            f"{unknown[:3]}{' and more' if len(unknown) > 3 else ''}, which are not parameters of the "
            f"model (its names: {sorted(known)[:3]}...); pass the dict FSDP.optim_state_dict() returned "
            f"for this model, not optim.state_dict()."
        )


def _state_to_load(entries: list[_OptimEntry], full_state: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each optimizer entry's state as this rank keeps it (its shard of a unit's flat state), by entry index."""
    state: dict[int, dict[str, Any]] = {}
    for index, entry in enumerate(entries):
        names = entry.names
        present = [n for n in names if n in full_state]
        if not present:
            continue
        if len(present) != len(names):
            missing = [n for n in names if n not in full_state]
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict has state for "
                f"'{present[0]}' but not for {missing}, which the optimizer steps as one flat "
                f"parameter (unit '{entry.unit._unit_state.label}'); save and load the whole model's "
                f"optimizer state."
            )
        device = entry.param.device
        # SHARDED (DTensor or ShardedTensor) entries: this entry's full values only, one entry at a time ([Note: Sharded
        # state dicts]); collective, in the optimizer's order on every rank.
        current = _with_full_values(full_state, names)
        if entry.orig_index is not None:
            state[index] = _orig_piece_state(entry, current[names[0]], device)
        elif entry.unit is None:
            state[index] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in current[names[0]].items()}
        else:
            state[index] = _flatten_state(entry, [current[n] for n in names], device)
        del current
    return state


def _groups_to_load(saved_groups: list[dict[str, Any]], optim: torch.optim.Optimizer,
                    optim_given: bool) -> list[dict[str, Any]]:
    """The saved param groups' settings over the optimizer's own parameter indices."""
    groups = []
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(
            f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict has {len(saved_groups)} "
            f"param groups but the optimizer has {len(optim.param_groups)}."
        )
    if optim_given:
        _check_same_kind(saved_groups, optim)
    position = 0
    for saved, current in zip(saved_groups, optim.param_groups):
        g = {k: v for k, v in saved.items() if k != "params"}
        g["params"] = list(range(position, position + len(current["params"])))
        position += len(current["params"])
        groups.append(g)
    return groups


# Param-group keys that differ between torch versions of one optimizer (each optimizer's __setstate__ fills them).
_VERSION_KEYS = {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay",
                 "initial_lr", "params"}


def _check_same_kind(saved_groups: list[dict[str, Any]], optim: torch.optim.Optimizer) -> None:
    """The saved param groups' hyperparameters are this optimizer's: state saved by another kind of optimizer
    (Adam's into SGD) would fail at its first step with a KeyError naming a hyperparameter, or step wrong."""
    for index, (saved, current) in enumerate(zip(saved_groups, optim.param_groups)):
        theirs, ours = set(saved) - _VERSION_KEYS, set(current) - _VERSION_KEYS
        if theirs != ours:
            kind = type(optim).__name__
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict was saved by another kind of "
                f"optimizer than this {kind}: its param group {index} has {sorted(theirs - ours)} where {kind}'s has "
                f"{sorted(ours - theirs)}. Load it into the kind of optimizer that saved it (with the same "
                f"param groups), or leave this {kind}'s state fresh.")


def _with_full_values(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``state`` with the DTensors (or ShardedTensors) of ``names``' entries as full tensors (a copy where
    anything changes; the caller's dict is left as it was). Collective."""
    pairs = {(name, key): value for name in names for key, value in state.get(name, {}).items()}
    if not any(is_sharded(v) for v in pairs.values()):
        return state
    state = dict(state)
    for name in names:
        if name in state:
            state[name] = dict(state[name])
    for (name, key), value in to_full(pairs).items():
        state[name][key] = value
    return state


def _unit_param_shapes(entries: list[_OptimEntry]) -> dict[str, torch.Size]:
    """Original name -> full shape, for every parameter a unit holds."""
    shapes: dict[str, torch.Size] = {}
    for entry in entries:
        if entry.unit is None:
            continue
        layout_shapes = entry.unit._unit_state.handle.layout.shapes
        if entry.orig_index is not None:
            shapes[entry.names[0]] = torch.Size(layout_shapes[entry.orig_index])
        else:
            shapes.update((n, torch.Size(shape)) for n, shape in zip(entry.names, layout_shapes))
    return shapes


class _OptimEntry:
    """One parameter the optimizer steps: a unit's flat shard (``unit`` set; ``names`` in flat
    order), an original parameter of a ``use_orig_params`` unit (``unit`` and ``orig_index``
    set; ``names`` its one name), or a plain parameter (``names`` is its one name)."""

    def __init__(self, param: nn.Parameter, unit: FullyShardedDataParallel | None, names: list[str], orig_index: int | None = None):
        self.param, self.unit, self.names, self.orig_index = param, unit, names, orig_index


def _optim_entries(model: nn.Module, optim: torch.optim.Optimizer, what: str) -> tuple[list[_OptimEntry], Any]:
    """The optimizer's parameters in its order, each with its original name(s); and the optim config."""
    units = fsdp_modules(model)
    if not units:
        raise ValueError(f"FullyShardedDataParallel.{what}: expected a model with FSDP units but found none")
    check_between_iterations(model, f"FullyShardedDataParallel.{what}")
    for root in fsdp_modules(model, root_only=True):
        if root._unit_state.is_root is None:
            lazy_init(root)
        _rank_guard.check(root._unit_state.root, f"{what}()")
    unit_of = {id(u._unit_state.flat_param): u for u in units if u._unit_state.handle is not None and not u._unit_state.config.use_orig_params}
    orig_of = {id(p): (u, i) for u in units if u._unit_state.handle is not None and u._unit_state.config.use_orig_params
               for i, p in enumerate(u._unit_state.orig_params)}
    # Names relative to ``model``: the unit's path in it, then the parameter's path in the unit.
    path_of = {id(m): clean_name(n) for n, m in model.named_modules() if is_unit(m)}
    plain_names: dict[int, str] = {}
    for name, p in model.named_parameters():
        if id(p) not in unit_of and id(p) not in orig_of:
            plain_names.setdefault(id(p), clean_name(name))
    entries = []
    for group_ in optim.param_groups:
        for p in group_["params"]:
            if id(p) in orig_of:
                unit, i = orig_of[id(p)]
                entries.append(_OptimEntry(p, unit, [join(path_of[id(unit)], unit._unit_state.param_local_names[i])], i))
                continue
            unit = unit_of.get(id(p))
            if unit is None:
                if id(p) not in plain_names:
                    raise ValueError(
                        f"FullyShardedDataParallel.{what}: the optimizer steps a parameter of shape "
                        f"{tuple(p.shape)} that is not in the model; pass the model the optimizer was built for."
                    )
                entries.append(_OptimEntry(p, None, [plain_names[id(p)]]))
                continue
            entries.append(_OptimEntry(p, unit, [join(path_of[id(unit)], n) for n in unit._unit_state.param_local_names]))
    return entries, units[0]._unit_state.optim_state_dict_config


def _check_same_state_keys(entries: list[_OptimEntry], osd: dict[str, Any]) -> None:
    """Every rank must have the same state keys per unit, or the gathers below would not pair up."""
    mine = [sorted(osd["state"].get(i, {})) if e.unit is not None and not e.unit._unit_state.handle.is_replicated
            and e.orig_index is None else None for i, e in enumerate(entries)]
    everyone: list[Any] = [None] * dist.get_world_size()
    with collective_range("optim_state_dict all_gather_object (state keys)"):
        dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        for entry, a, b in zip(entries, mine, theirs):
            if a != b:
                raise ValueError(
                    f"FullyShardedDataParallel.optim_state_dict: unit '{entry.unit._unit_state.label}' has "
                    f"optimizer state {a} on rank {dist.get_rank()} but {b} on rank {rank}; every rank must "
                    f"step the same parameters before saving (e.g. call optim.step() on every rank)."
                )


def _unflatten_state(entry: _OptimEntry, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One unit's flat-shard optimizer state as full per-parameter state. Collective over its shard group."""
    unit = entry.unit
    handle = unit._unit_state.handle
    layout = handle.layout
    per_param: dict[str, dict[str, Any]] = {n: {} for n in entry.names}

    def per_element(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == entry.param.shape

    # torch's order: the per-element state, then the rest (each in the optimizer's order,
    # which is the same on every rank: the collectives below follow it).
    keys = [k for k in values if per_element(values[k])] + [k for k in values if not per_element(values[k])]
    for key in keys:
        value = values[key]
        if per_element(value):
            flat = value.detach()
            if not handle.is_replicated:
                # On the compute device: an offloaded shard's state is on the host.
                local = flat.to(unit._unit_state.device).contiguous()
                gathered = local.new_empty(layout.padded_numel)
                with collective_range("optim_state_dict all_gather", unit._unit_state.name):
                    dist.all_gather_into_tensor(gathered, local, group=unit._unit_state.config.process_group)
                flat = gathered
            for name, offset, numel, shape in zip(entry.names, layout.offsets, layout.numels, layout.shapes):
                per_param[name][key] = flat[offset : offset + numel].view(shape).clone()
        else:
            for name in entry.names:
                per_param[name][key] = value.clone() if isinstance(value, torch.Tensor) else value
    return per_param


def _flatten_state(entry: _OptimEntry, saved: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Full per-parameter optimizer state (in the unit's flat order) as this rank's flat-shard state."""
    handle = entry.unit._unit_state.handle
    layout = handle.layout
    out: dict[str, Any] = {}
    if all(len(shape) == 0 for shape in layout.shapes):
        raise NotImplementedError(
            f"FullyShardedDataParallel.optim_state_dict_to_load: unit '{entry.unit._unit_state.label}' "
            f"holds only 0-dim parameters, whose per-element state cannot be told from a scalar such "
            f"as 'step'; wrap them together with other parameters."
        )
    for key in saved[0]:
        first = saved[0][key]
        shaped = [isinstance(s.get(key), torch.Tensor) and tuple(s[key].shape) == tuple(shape)
                  for s, shape in zip(saved, layout.shapes)]
        any_dims = any(isinstance(s.get(key), torch.Tensor) and s[key].dim() > 0 for s in saved)
        if any_dims and all(shaped):
            flat = torch.cat([s[key].detach().reshape(-1).to(device) for s in saved])
            flat = torch.cat([flat, flat.new_zeros(layout.padded_numel - flat.numel())])
            begin, end = layout.shard_range(handle.rank)
            out[key] = flat[begin:end].clone()
        elif any_dims:
            bad = [n for n, ok in zip(entry.names, shaped) if not ok][0]
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: state '{key}' of '{bad}' does not have "
                f"the parameter's shape; expected a state dict from FSDP.optim_state_dict()."
            )
        else:  # a scalar such as Adam's step: the optimizer's load_state_dict places it
            out[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return out


def _orig_slices(unit: FullyShardedDataParallel) -> dict[int, tuple[int, int, int]]:
    """param index -> (offset in the parameter, offset in the shard, numel) of this rank's piece."""
    handle = unit._unit_state.handle
    layout = handle.layout
    if handle.is_replicated:
        return {i: (0, layout.offsets[i], layout.numels[i]) for i in range(layout.num_params)}
    return {i: (op, os_, n) for i, op, os_, n in layout.shard_slices(handle.rank)}


def _unflatten_orig_state(unit: FullyShardedDataParallel, members: list[tuple[int, _OptimEntry]], osd: dict[str, Any]) -> dict:
    """A ``use_orig_params`` unit's optimizer state, kept per piece of parameter in this rank's
    shard, as full per-parameter state: the pieces are laid into a flat shard per key and
    all-gathered (collective over the unit's shard group). Keys must agree across ranks."""
    handle = unit._unit_state.handle
    layout = handle.layout
    slices = _orig_slices(unit)
    shard_numel = layout.padded_numel if handle.is_replicated else layout.shard_numel
    out: dict[str, dict[str, Any]] = {entry.names[0]: {} for _, entry in members}
    for key, (kind, info) in _orig_state_kinds(unit, members, osd, slices).items():
        flat = torch.zeros(shard_numel, dtype=getattr(torch, info), device=unit._unit_state.device) if kind == "tensor" else None
        scalar = info if kind == "scalar" else None
        for index, entry in members:
            value = osd["state"].get(index, {}).get(key)
            if value is not None and flat is not None and _per_element(entry, value):
                _, offset_in_shard, numel = slices.get(entry.orig_index, (0, 0, 0))
                flat[offset_in_shard : offset_in_shard + numel] = value.detach().reshape(-1).to(unit._unit_state.device)
        if flat is not None and not handle.is_replicated:
            gathered = flat.new_empty(layout.padded_numel)
            with collective_range("optim_state_dict all_gather", unit._unit_state.name):
                dist.all_gather_into_tensor(gathered, flat, group=unit._unit_state.config.process_group)
            flat = gathered
        for index, entry in members:
            i = entry.orig_index
            name = entry.names[0]
            if flat is not None:
                offset, numel = layout.offsets[i], layout.numels[i]
                out[name][key] = flat[offset : offset + numel].view(layout.shapes[i]).clone()
            elif scalar is not None:
                out[name][key] = scalar.clone() if isinstance(scalar, torch.Tensor) else scalar
    return {name: values for name, values in out.items() if values}


def _per_element(entry: _OptimEntry, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == entry.param.shape


def _orig_state_kinds(unit: FullyShardedDataParallel, members: list[tuple[int, _OptimEntry]], osd: dict[str, Any],
                      slices: dict[int, tuple[int, int, int]]) -> dict[str, tuple[str, Any]]:
    """What each optimizer-state key of a use_orig_params unit is (per-element, with its dtype, or a scalar such
    as 'step', with its value), agreed by every rank of the unit's shard group (collective): a rank whose pieces
    of this unit's trainable parameters are all empty (its shard holds frozen parameters only, see [Note:
    Trainable prefix]) has no state of its own."""
    kinds: dict[str, tuple[str, Any]] = {}
    for index, entry in members:
        for k, value in osd["state"].get(index, {}).items():
            if k not in kinds:
                kinds[k] = ("tensor", str(value.dtype).removeprefix("torch.")) if _per_element(entry, value) else \
                    ("scalar", value)
    if not unit._unit_state.handle.is_replicated:
        holds_trainable = any(slices.get(e.orig_index, (0, 0, 0))[2] > 0 and e.param.requires_grad
                              for _, e in members)
        everyone: list[Any] = [None] * dist.get_world_size(unit._unit_state.config.process_group)
        with collective_range("optim_state_dict all_gather_object (state kinds)", unit._unit_state.name):
            dist.all_gather_object(everyone, (holds_trainable, list(kinds.items())),
                                   group=unit._unit_state.config.process_group)
        merged: dict[str, tuple[str, Any]] = {}
        for _, theirs in everyone:
            for k, kind in theirs:
                merged.setdefault(k, kind)
        key_sets = [sorted(k for k, _ in theirs) for held, theirs in everyone if held]
        if any(keys != key_sets[0] for keys in key_sets) or (holds_trainable and sorted(kinds) != sorted(merged)):
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict: unit '{unit._unit_state.label}' has optimizer "
                f"state {sorted(kinds)} on this rank but {[sorted(k for k, _ in t) for _, t in everyone]} across "
                f"its ranks; every rank must step the same parameters before saving (e.g. call optim.step() on "
                f"every rank)."
            )
        kinds = merged
    return kinds


def _orig_piece_state(entry: _OptimEntry, saved: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A parameter's full optimizer state as the state of its piece in this rank's shard."""
    unit = entry.unit
    shape = tuple(unit._unit_state.handle.layout.shapes[entry.orig_index])
    offset_in_param, _, numel = _orig_slices(unit).get(entry.orig_index, (0, 0, 0))
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == shape and shape != ():
            piece = value.detach().reshape(-1)[offset_in_param : offset_in_param + numel].to(device)
            out[key] = piece.view(entry.param.shape).clone()
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


# ----------------------------------------------------------- torch's older functions
# [Note: Older optimizer-state functions]
# torch's FSDP1 kept these from before optim_state_dict(); recipes still call them.
# full_optim_state_dict is optim_state_dict with its own rank0_only (default True)
# and the state offloaded to the host; shard_full_optim_state_dict (every rank holds
# the full dict) and scatter_full_optim_state_dict (rank 0 does) are
# optim_state_dict_to_load; rekey_optim_state_dict switches the keys between the
# original parameter names and their positions in the unwrapped model's
# parameters() (OptimStateKeyType), e.g. to load into a model without FSDP; as
# torch, each group's parameter list comes out sorted. sharded_optim_state_dict is
# optim_state_dict as under SHARDED_STATE_DICT (ShardedTensors, as torch's)
# and flatten_sharded_optim_state_dict is optim_state_dict_to_load.


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                             group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    units = fsdp_modules(model)
    saved = [u._unit_state.state_dict_type for u in units]
    for u in units:
        u._unit_state.state_dict_type = StateDictType.SHARDED_STATE_DICT
    try:
        return optim_state_dict(model, optim, None, group, rank0_only=False)
    finally:
        for u, t in zip(units, saved):
            u._unit_state.state_dict_type = t


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                     optim: torch.optim.Optimizer) -> dict[str, Any]:
    return optim_state_dict_to_load(model, optim, sharded_optim_state_dict, from_rank0=False)


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                          rank0_only: bool = True, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    _no_optim_input(optim_input, "full_optim_state_dict")
    return optim_state_dict(model, optim, group=group, rank0_only=rank0_only, offload_to_cpu=True)


def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module, optim_input: Any = None,
                                optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    _no_optim_input(optim_input, "shard_full_optim_state_dict")
    return optim_state_dict_to_load(model, _optim_or_default(model, optim), full_optim_state_dict, from_rank0=False,
                                    _optim_given=optim is not None)


def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                  optim_input: Any = None, optim: torch.optim.Optimizer | None = None,
                                  group: Any = None) -> dict[str, Any]:
    _no_optim_input(optim_input, "scatter_full_optim_state_dict")
    if group is not None:
        raise ValueError(
            "FullyShardedDataParallel.scatter_full_optim_state_dict: group= must be the model's group; "
            "flatshard uses each unit's own groups, so leave it unset."
        )
    return optim_state_dict_to_load(model, _optim_or_default(model, optim), full_optim_state_dict, from_rank0=True,
                                    _optim_given=optim is not None)


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: Any, model: nn.Module,
                           optim_input: Any = None, optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    from torch.distributed.fsdp import OptimStateKeyType

    _no_optim_input(optim_input, "rekey_optim_state_dict")
    names = unwrapped_parameter_names(model)
    index_of = {n: i for i, n in enumerate(names)}
    if optim_state_key_type == OptimStateKeyType.PARAM_ID:
        key = lambda k: index_of[k] if isinstance(k, str) and k in index_of else k  # noqa: E731
    elif optim_state_key_type == OptimStateKeyType.PARAM_NAME:
        key = lambda k: names[k] if isinstance(k, int) and 0 <= k < len(names) else k  # noqa: E731
    else:
        raise ValueError(
            f"FullyShardedDataParallel.rekey_optim_state_dict: expected an OptimStateKeyType but got "
            f"{optim_state_key_type!r}"
        )
    state = {key(k): v for k, v in optim_state_dict["state"].items()}
    # Sorted, as torch does: an optimizer's load_state_dict pairs saved and current
    # parameters by position, so ids must come in the model's order.
    groups = [{**g, "params": sorted(key(k) for k in g["params"])} for g in optim_state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def unwrapped_parameter_names(model: nn.Module) -> list[str]:
    """The names ``model.named_parameters()`` would give without FSDP, in that order: each
    module's own parameters as registered (flattened ones from its unit's slots), a tied
    parameter once, under its first name."""
    slots: dict[int, list[tuple[str, tuple[int, int]]]] = {}  # id(module) -> [(attribute, (unit, index))]
    for unit in fsdp_modules(model):
        if unit._unit_state.handle is None or unit._unit_state.config.use_orig_params:
            continue
        for m, attr, index in unit._unit_state.param_slots:
            slots.setdefault(id(m), []).append((attr, (id(unit), index)))
    names: list[str] = []
    seen: set = set()
    for path, m in model.named_modules():
        clean = clean_name(path)
        entries = [(attr, id(p)) for attr, p in m._parameters.items() if p is not None and attr != "_flat_param"]
        entries += slots.get(id(m), [])
        for attr, identity in entries:
            if identity not in seen:
                seen.add(identity)
                names.append(join(clean, attr))
    return names


def _no_optim_input(optim_input: Any, what: str) -> None:
    if optim_input is not None:
        raise ValueError(
            f"FullyShardedDataParallel.{what}: optim_input is deprecated in torch and not taken by flatshard; "
            f"pass optim= (the optimizer), or nothing if it was built from model.parameters()."
        )


def _optim_or_default(model: nn.Module, optim: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
    """The optimizer the state is for; without one, one built on model.parameters() (torch's assumption)."""
    return optim if optim is not None else torch.optim.SGD(model.parameters(), lr=0.0)
