"""SHARDED_STATE_DICT and LOCAL_STATE_DICT: each original parameter (and its optimizer
state) as a DTensor, or each unit's flat shard as one.

[Note: Sharded state dicts]
As torch's FSDP1 writes them, so that a checkpoint is interchangeable with one
torch wrote: under the original names, each parameter is a DTensor over its
unit's shard group, ``Shard(0)`` (with hybrid sharding ``[Replicate(), Shard(0)]``
over the (replicate, shard) mesh): the full parameter split along its first
dimension as ``DTensor.redistribute`` splits it (rank r keeps chunk r; ranks past
the last chunk hold an empty tensor). This is not flatshard's flat layout, so
saving gathers each unit's full parameters (one unit at a time) and cuts them
again; loading does the reverse one unit at a time too (``load_per_unit``, which loads FULL
state dicts as well): the
unit's DTensors to full values (``full_tensor``), copied into its summoned
parameters, written back, dropped, so that the extra memory is one unit's, as
with torch's FSDP1 (the optimizer's state likewise, one flat parameter at a time).
DCP reads these DTensors at any world size: saved at W=4, loaded at W=2, the
target DTensors describe the same global tensors.
Buffers and ignored parameters stay plain tensors (the same on every rank).

[Note: Local state dicts]
LOCAL_STATE_DICT keeps flatshard's own layout: per unit, ``<unit path>._flat_param``
is the flat parameter as a 1-D DTensor of its unpadded length, ``Shard(0)`` over the
shard group (replicated where the unit is), each rank holding its shard without the
padding (as torch's FSDP1 does with a ShardedTensor), and
``<unit path>._flat_param_layout`` records what the flat order means (the names,
shapes and dtype of the parameters in it). Loading checks that record against the
unit and copies the shard in place, without gathering anything. Because the length
is unpadded and the chunks are ``torch.chunk``'s, DCP can load such a checkpoint at
another world size, as long as the units hold the same parameters.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatshard import _rank_guard
from flatshard._common import FLAT_PARAM, check_between_iterations, clean_name, fsdp_modules, join
from flatshard._full_params import summon_full_params
from flatshard._mixed_precision import original_buffer_dtypes
from flatshard.api import StateDictType

LAYOUT_SUFFIX = "_flat_param_layout"


def mesh_of(unit: Any) -> DeviceMesh:
    """The unit's DTensor mesh: its shard group, or (replicate, shard) with hybrid sharding (cached)."""
    mesh = unit.__dict__.get("_dtensor_mesh")
    if mesh is not None:
        return mesh
    device_type = unit._device.type
    if unit._replicate_group is None:
        mesh = DeviceMesh.from_group(unit._process_group, device_type)
    else:
        # The whole layout: global rank of (replicate rank i, shard rank j), from every rank.
        mine = (dist.get_rank(unit._replicate_group), dist.get_rank(unit._process_group), dist.get_rank())
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        replicas, shards = dist.get_world_size(unit._replicate_group), dist.get_world_size(unit._process_group)
        layout = torch.empty(replicas, shards, dtype=torch.int64)
        for i, j, g in everyone:
            layout[i, j] = g
        mesh = DeviceMesh.from_group([unit._replicate_group, unit._process_group], device_type, mesh=layout,
                                     mesh_dim_names=("replicate", "shard"))
    unit.__dict__["_dtensor_mesh"] = mesh
    return mesh


def to_dtensor(full: torch.Tensor, unit: Any, offload_to_cpu: bool = False) -> DTensor:
    """A full tensor (the same on every rank of the unit) as this rank's chunk of a DTensor."""
    mesh = mesh_of(unit)
    replicate = [Replicate()] * mesh.ndim
    shard = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    tensor = full.detach().clone()
    if tensor.dim() == 0:  # a scalar cannot be cut: replicated, as torch keeps it
        return DTensor.from_local(tensor, mesh, replicate, run_check=False)
    dt = DTensor.from_local(tensor, mesh, replicate, run_check=False).redistribute(placements=shard)
    if offload_to_cpu and dt.to_local().device.type != "cpu":
        dt = DTensor.from_local(dt.to_local().cpu(), mesh, shard, run_check=False, shape=dt.shape,
                                stride=dt.stride())
    return dt


def is_sharded(value: Any) -> bool:
    """A DTensor, or a ShardedTensor (torch FSDP1's sharded values, and torch's DCP optimizer reader's)."""
    return isinstance(value, (DTensor, ShardedTensor))


def to_full(state: dict[Any, Any]) -> dict[Any, Any]:
    """Every DTensor and ShardedTensor in ``state`` (keys of one sortable type) as its full tensor;
    collective, in sorted key order on every rank."""
    out = dict(state)
    for name in sorted(k for k, v in state.items() if is_sharded(v)):
        value = state[name]
        if isinstance(value, ShardedTensor):
            out[name] = _sharded_tensor_to_full(value)
            continue
        if value.device.type != value.device_mesh.device_type:  # offloaded: back to the mesh's device
            value = DTensor.from_local(value.to_local().to(value.device_mesh.device_type), value.device_mesh,
                                       value.placements, run_check=False, shape=value.shape, stride=value.stride())
        out[name] = value.full_tensor()
    return out


def _sharded_tensor_to_full(value: ShardedTensor) -> torch.Tensor:
    """A ShardedTensor's full value on every rank of its group (through the host: loading only)."""
    mine = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()]
    group = value._process_group
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    device = value.local_shards()[0].tensor.device if value.local_shards() else torch.device("cpu")
    full = torch.empty(value.size(), dtype=value.dtype)
    for shards in everyone:
        for offsets, tensor in shards:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    return full.to(device)


def sharded_or_local_state_dict(unit: Any, destination: Any, prefix: str) -> Any:
    """``unit.state_dict()`` under SHARDED_STATE_DICT or LOCAL_STATE_DICT (see the notes above). Collective."""
    if unit._is_root is None:
        unit._lazy_init()
    check_between_iterations(unit, "FullyShardedDataParallel.state_dict")
    _rank_guard.check(unit, "state_dict()")
    config = unit._state_dict_config
    entries: dict[str, Any] = {}
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    managed: set[int] = set()
    local = unit._state_dict_type == StateDictType.LOCAL_STATE_DICT
    for u in fsdp_modules(unit):  # one unit's full parameters at a time
        if u._handle is None:
            continue
        managed.add(id(u._flat_param))
        if u._use_orig_params:
            managed.update(id(p) for p in u._orig_params)
        if local:
            entries[join(paths[id(u)], FLAT_PARAM)] = _local_dtensor(u, config.offload_to_cpu)
            entries[join(paths[id(u)], LAYOUT_SUFFIX)] = _layout_record(u)
            continue
        with summon_full_params(u, recurse=False, writeback=False, guard_phase=None):
            for m, attr, _ in u._param_slots:
                full = m._parameters[attr]
                entries[join(paths[id(m)], attr)] = to_dtensor(full, u, config.offload_to_cpu)
    buffer_dtypes = original_buffer_dtypes(unit)
    units = fsdp_modules(unit)
    for u in units:  # nested units answer as plain modules here
        u.__dict__["_plain_state_dict"] = True
    try:
        rest = nn.Module.state_dict(unit, keep_vars=True)
    finally:
        for u in units:
            u.__dict__["_plain_state_dict"] = False
    for name, value in rest.items():  # buffers, ignored parameters
        if isinstance(value, torch.Tensor):
            if id(value) in managed:
                continue
            value = value.detach().to(buffer_dtypes.get(id(value), value.dtype))
            if config.offload_to_cpu:
                value = value.cpu()
        entries[clean_name(name)] = value
    # torch's order: modules in pre-order, each module's parameters before its buffers.
    module_order = {path: i for i, path in enumerate(paths.values())}
    buffers = {join(paths[id(m)], b) for m in unit.modules() for b in m._buffers}

    def position(item: tuple[int, str]) -> tuple[int, int, int]:
        index, name = item
        return (module_order.get(name.rpartition(".")[0], len(module_order)), name in buffers, index)

    out = destination if destination is not None else collections.OrderedDict()
    for _, name in sorted(enumerate(entries), key=position):
        out[prefix + name] = entries[name]
    return out


def _layout_record(unit: Any) -> dict[str, Any]:
    layout = unit._handle.layout
    return {"names": list(unit._param_local_names), "shapes": [list(shape) for shape in layout.shapes],
            "dtype": str(unit._flat_param.dtype), "numel": layout.unpadded_numel}


def _local_dtensor(unit: Any, offload_to_cpu: bool) -> DTensor:
    """The unit's flat shard, without padding, as a 1-D DTensor of the unpadded length."""
    handle, layout = unit._handle, unit._handle.layout
    mesh = mesh_of(unit)
    shard = unit._flat_param.detach()
    numel = layout.unpadded_numel
    if handle.is_replicated:
        local, placements = shard[:numel], [Replicate()] * mesh.ndim
    else:
        size = layout.shard_numel
        if size != math.ceil(numel / layout.shard_factor):
            raise NotImplementedError(
                f"FullyShardedDataParallel.state_dict: unit '{unit._unit_name or '<root>'}' has an aligned layout "
                f"(shard of {size} for {numel} elements over {layout.shard_factor} ranks), which "
                f"LOCAL_STATE_DICT cannot describe; use SHARDED_STATE_DICT."
            )
        begin = min(handle.rank * size, numel)
        local = shard[: min(size, numel - begin)]
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    local = local.cpu().clone() if offload_to_cpu else local.clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def prepare_local_load(unit: Any, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """Before ``load_state_dict`` of a LOCAL_STATE_DICT: checks each unit's layout record and
    copies its shard in place, then leaves the (renamed) rest to ``nn.Module``'s loading.
    Returns the flat parameters' keys the state dict lacks."""
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    missing: list[str] = []
    for u in fsdp_modules(unit):
        if u._handle is None:
            continue
        name = prefix + join(paths[id(u)], FLAT_PARAM)
        value = state_dict.get(name)
        record = state_dict.pop(prefix + join(paths[id(u)], LAYOUT_SUFFIX), None)
        if value is u._flat_param:  # done by an outer unit
            continue
        if value is None:
            missing.append(name)
            _hand_registered_to_nn_module(u, state_dict, prefix, paths)
            continue
        where = f"unit '{u._unit_name or '<root>'}'"
        mine = _layout_record(u)
        if record is not None and record != mine:
            diff = ", ".join(f"{k}: {record.get(k)} != {mine[k]}" for k in mine if record.get(k) != mine[k])
            raise ValueError(
                f"FullyShardedDataParallel.load_state_dict: the LOCAL_STATE_DICT for {where} was saved with "
                f"another layout ({diff[:400]}); a local state dict loads only into the same wrapping. Save "
                f"with SHARDED_STATE_DICT to change the model or its wrapping."
            )
        expected = _local_dtensor(u, offload_to_cpu=False)
        if isinstance(value, DTensor):
            if value.shape != expected.shape:
                raise ValueError(f"FullyShardedDataParallel.load_state_dict: {name} has {value.numel()} elements "
                                 f"but {where} holds {expected.numel()}; a local state dict loads only into the "
                                 f"same wrapping.")
            value = value.to_local()
        if not isinstance(value, torch.Tensor) or value.shape != expected.to_local().shape:
            raise ValueError(
                f"FullyShardedDataParallel.load_state_dict: {name} should be this rank's shard of "
                f"{tuple(expected.to_local().shape)} for {where} but is "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}; load a "
                f"LOCAL_STATE_DICT at the world size it was saved at, or through torch.distributed.checkpoint "
                f"(which reshards)."
            )
        with torch.no_grad():
            u._flat_param.detach()[: value.numel()].copy_(value)
        del state_dict[name]
        _hand_registered_to_nn_module(u, state_dict, prefix, paths)
    rename_to_wrapped(unit, state_dict, prefix)
    return missing


def load_per_unit(unit: Any, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """Before ``load_state_dict`` of a FULL or SHARDED state dict: one unit at a time, takes its entries'
    full values (gathering DTensors) and copies them into its summoned parameters, so that the extra
    memory is one unit's (see [Note: Sharded state dicts]); leaves the (renamed) rest to
    ``nn.Module``'s loading. Returns the parameters' keys the state dict lacks. Collective."""
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    missing: list[str] = []
    for u in fsdp_modules(unit):
        if u._handle is None:
            continue
        keys = [prefix + join(paths[id(m)], attr) for m, attr, _ in u._param_slots]
        missing += [k for k in keys if k not in state_dict]
        full = to_full({k: state_dict[k] for k in keys if k in state_dict})  # same keys on every rank
        with summon_full_params(u, recurse=False, writeback=True, guard_phase=None), torch.no_grad():
            for (m, attr, _), key in zip(u._param_slots, keys):
                if key not in full:
                    continue
                param, value = m._parameters[attr], full[key]
                if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                    raise RuntimeError(
                        f"Error(s) in loading state_dict for {type(unit).__name__}: size mismatch for {key}: "
                        f"copying a param with shape {tuple(getattr(value, 'shape', ()))} from checkpoint, the "
                        f"shape in current model is {tuple(param.shape)}.")
                param.copy_(value)
        del full
        for key in keys:
            state_dict.pop(key, None)
        _hand_registered_to_nn_module(u, state_dict, prefix, paths)
    rename_to_wrapped(unit, state_dict, prefix)
    return missing


def _hand_registered_to_nn_module(unit: Any, state_dict: dict[str, Any], prefix: str, paths: dict[int, str]) -> None:
    """After ``unit`` is loaded (or found missing, and reported as such): its registered parameters go into
    ``state_dict`` as themselves, so that ``nn.Module``'s loading copies them onto themselves and reports
    nothing for them (the original parameters with ``use_orig_params``, else the flat parameter)."""
    if unit._use_orig_params:
        for m, attr, _ in unit._param_slots:
            state_dict[prefix + join(paths[id(m)], attr)] = m._parameters[attr]
    else:
        state_dict[prefix + join(paths[id(unit)], FLAT_PARAM)] = unit._flat_param


def rename_to_wrapped(unit: Any, state_dict: dict[str, Any], prefix: str) -> None:
    """Entries under the original names to the names ``nn.Module``'s loading looks for (with the wrappers')."""
    for actual, _ in [*nn.Module.named_parameters(unit, remove_duplicate=False),
                      *nn.Module.named_buffers(unit, remove_duplicate=False)]:
        clean = clean_name(actual)
        if clean != actual and prefix + clean in state_dict and prefix + actual not in state_dict:
            state_dict[prefix + actual] = state_dict.pop(prefix + clean)
