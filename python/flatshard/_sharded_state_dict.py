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
again; loading does the reverse one unit at a time too (see [Note: Loading state
dicts] in _state_dict_load.py), so that the extra memory is one unit's, as with
torch's FSDP1 (the optimizer's state likewise, one flat parameter at a time).
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
from typing import TYPE_CHECKING, Any

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
from flatshard._profiling import collective_range
from flatshard._runtime import lazy_init
from flatshard.api import StateDictType

if TYPE_CHECKING:
    from flatshard._state import UnitState
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel

LAYOUT_SUFFIX = "_flat_param_layout"


def mesh_of(unit: FullyShardedDataParallel) -> DeviceMesh:
    """The unit's DTensor mesh: its shard group, or (replicate, shard) with hybrid sharding (cached)."""
    s = unit._unit_state
    if s.dtensor_mesh is not None:
        return s.dtensor_mesh
    device_type = s.device.type
    if s.replicate_group is None:
        mesh = DeviceMesh.from_group(s.process_group, device_type)
    else:
        # The whole layout: global rank of (replicate rank i, shard rank j), from every rank.
        mine = (dist.get_rank(s.replicate_group), dist.get_rank(s.process_group), dist.get_rank())
        everyone: list[Any] = [None] * dist.get_world_size()
        with collective_range("state_dict all_gather_object (hybrid mesh)", s.name):
            dist.all_gather_object(everyone, mine)
        replicas, shards = dist.get_world_size(s.replicate_group), dist.get_world_size(s.process_group)
        layout = torch.empty(replicas, shards, dtype=torch.int64)
        for i, j, g in everyone:
            layout[i, j] = g
        mesh = DeviceMesh.from_group([s.replicate_group, s.process_group], device_type, mesh=layout,
                                     mesh_dim_names=("replicate", "shard"))
    s.dtensor_mesh = mesh
    return mesh


def to_dtensor(full: torch.Tensor, unit: FullyShardedDataParallel, offload_to_cpu: bool = False) -> DTensor:
    """A full tensor (the same on every rank of the unit) as this rank's chunk of a DTensor."""
    mesh = mesh_of(unit)
    replicate = [Replicate()] * mesh.ndim
    shard = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    tensor = full.detach().clone()
    if tensor.dim() == 0:  # a scalar cannot be cut: replicated, as torch keeps it
        return DTensor.from_local(tensor, mesh, replicate, run_check=False)
    with collective_range("state_dict redistribute (to DTensor)", unit._unit_state.name):
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
        with collective_range(f"load full_tensor ({name})"):
            out[name] = value.full_tensor()
    return out


def _sharded_tensor_to_full(value: ShardedTensor) -> torch.Tensor:
    """A ShardedTensor's full value on every rank of its group (through the host: loading only)."""
    mine = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()]
    group = value._process_group
    everyone: list[Any] = [None] * dist.get_world_size(group)
    with collective_range("load all_gather_object (ShardedTensor)"):
        dist.all_gather_object(everyone, mine, group=group)
    device = value.local_shards()[0].tensor.device if value.local_shards() else torch.device("cpu")
    full = torch.empty(value.size(), dtype=value.dtype)
    for shards in everyone:
        for offsets, tensor in shards:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    return full.to(device)


def sharded_or_local_state_dict(unit: FullyShardedDataParallel, destination: Any, prefix: str) -> Any:
    """``unit.state_dict()`` under SHARDED_STATE_DICT or LOCAL_STATE_DICT (see the notes above). Collective."""
    if unit._unit_state.is_root is None:
        lazy_init(unit)
    check_between_iterations(unit, "FullyShardedDataParallel.state_dict")
    _rank_guard.check(unit._unit_state.root, "state_dict()")
    config = unit._unit_state.state_dict_config
    entries: dict[str, Any] = {}
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    managed: set[int] = set()
    local = unit._unit_state.state_dict_type == StateDictType.LOCAL_STATE_DICT
    for u in fsdp_modules(unit):  # one unit's full parameters at a time
        if u._unit_state.handle is None:
            continue
        managed.add(id(u._unit_state.flat_param))
        if u._unit_state.use_orig_params:
            managed.update(id(p) for p in u._unit_state.orig_params)
        if local:
            entries[join(paths[id(u)], FLAT_PARAM)] = local_dtensor(u, config.offload_to_cpu)
            entries[join(paths[id(u)], LAYOUT_SUFFIX)] = layout_record(u._unit_state)
            continue
        with summon_full_params(u, recurse=False, writeback=False, guard_phase=None):
            for m, attr, _ in u._unit_state.param_slots:
                full = m._parameters[attr]
                entries[join(paths[id(m)], attr)] = to_dtensor(full, u, config.offload_to_cpu)
    buffer_dtypes = original_buffer_dtypes(unit)
    units = fsdp_modules(unit)
    for u in units:  # nested units answer as plain modules here
        u._unit_state.plain_state_dict = True
    try:
        rest = nn.Module.state_dict(unit, keep_vars=True)
    finally:
        for u in units:
            u._unit_state.plain_state_dict = False
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


def layout_record(s: UnitState) -> dict[str, Any]:
    """What a unit's flat order means, saved beside its LOCAL_STATE_DICT entry and checked on load."""
    layout = s.handle.layout
    return {"names": list(s.param_local_names), "shapes": [list(shape) for shape in layout.shapes],
            "dtype": str(s.flat_param.dtype), "numel": layout.unpadded_numel}


def local_dtensor(unit: FullyShardedDataParallel, offload_to_cpu: bool) -> DTensor:
    """The unit's flat shard, without padding, as a 1-D DTensor of the unpadded length."""
    s = unit._unit_state
    handle, layout = s.handle, s.handle.layout
    mesh = mesh_of(unit)
    shard = s.flat_param.detach()
    numel = layout.unpadded_numel
    if handle.is_replicated:
        local, placements = shard[:numel], [Replicate()] * mesh.ndim
    else:
        size = layout.shard_numel
        if size != math.ceil(numel / layout.shard_factor):
            raise NotImplementedError(
                f"FullyShardedDataParallel.state_dict: unit '{s.label}' has an aligned layout "
                f"(shard of {size} for {numel} elements over {layout.shard_factor} ranks), which "
                f"LOCAL_STATE_DICT cannot describe; use SHARDED_STATE_DICT."
            )
        begin = min(handle.rank * size, numel)
        local = shard[: min(size, numel - begin)]
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    local = local.cpu().clone() if offload_to_cpu else local.clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))
