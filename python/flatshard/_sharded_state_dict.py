"""SHARDED_STATE_DICT and LOCAL_STATE_DICT: each original parameter (and its optimizer
state) cut into this rank's chunk, or each unit's flat shard.

[Note: Sharded state dicts]
As torch's FSDP1 writes them, so that a checkpoint is interchangeable with one
torch wrote: under the original names, each parameter is the full parameter split
along its first dimension as ``torch.chunk`` splits it over the unit's shard group
(rank r keeps chunk r; ranks past the last chunk hold nothing). As torch's FSDP1,
the value is a ``ShardedTensor`` (``.local_shards()``), or a DTensor (``Shard(0)``;
with hybrid sharding ``[Replicate(), Shard(0)]`` over the (replicate, shard) mesh)
when the model was built from a ``device_mesh`` or the config's ``_use_dtensor``
asks: ``uses_dtensor`` (flatshard.checkpoint's ``get_state_dict`` asks for DTensors: a
ShardedTensor has no shard on the ranks past a small parameter's last chunk, which DCP cannot
load an optimizer state dict into; torch's helpers fail there). This is not flatshard's flat
layout, so saving gathers each unit's full parameters (one unit at a time) and cuts
them again; loading does the reverse one unit at a time too (see [Note: Loading
state dicts] in _state_dict_load.py), so that the extra memory is one unit's, as
with torch's FSDP1 (the optimizer's state likewise, one flat parameter at a time).
DCP reads either kind at any world size: saved at W=4, loaded at W=2, the target
values describe the same global tensors. Buffers and ignored parameters stay plain
tensors (the same on every rank); so does a 0-dimensional parameter.

[Note: Local state dicts]
LOCAL_STATE_DICT is torch FSDP1's format: per unit, ``<unit path>._flat_param`` is the
flat parameter as a 1-D ShardedTensor (or DTensor, as above) of its unpadded length over
the shard group (a replicated DTensor where the unit is replicated), each rank holding
its shard without the padding, and nothing else beside the buffers. What the flat order
means (the names, shapes and dtype of the parameters in it: the layout record) rides where
torch's format has room for it: the unit's entry of the state dict's ``_metadata`` (where
``nn.Module`` keeps each module's version), under ``flatshard_layout``; ``torch.save`` keeps
it and ``load_state_dict`` hands it to the unit, which checks it and copies the shard in
place, without gathering anything, so that a foreign or stale LOCAL dict fails with the
difference named instead of loading into the wrong parameters. A dict rebuilt without
``_metadata`` (or read through DCP into a template) is checked by its length only, as torch's
FSDP1 does. Because the length is unpadded and the chunks are ``torch.chunk``'s, DCP can load
such a checkpoint at another world size, as long as the units hold the same parameters; and
without ``use_orig_params`` (where torch's FSDP1 adds no alignment padding) LOCAL dicts load
into torch's FSDP1 and back (tests/test_torch_compat.py).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as ShardedTensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
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

LAYOUT_SUFFIX = "_flat_param_layout"  # (a key of flatshard's LOCAL state dicts before 2026-11-28: still read on load)
LAYOUT_METADATA = "flatshard_layout"  # its place now: the unit's entry of the state dict's _metadata


def mesh_of(unit: FullyShardedDataParallel) -> DeviceMesh:
    """The unit's DTensor mesh: its shard group, or (replicate, shard) with hybrid sharding (cached)."""
    s = unit._unit_state
    if s.dtensor_mesh is not None:
        return s.dtensor_mesh
    device_type = s.device.type
    if s.config.replicate_group is None:
        mesh = DeviceMesh.from_group(s.config.process_group, device_type)
    else:
        # The whole layout: global rank of (replicate rank i, shard rank j), from every rank.
        mine = (dist.get_rank(s.config.replicate_group), dist.get_rank(s.config.process_group), dist.get_rank())
        everyone: list[Any] = [None] * dist.get_world_size()
        with collective_range("state_dict all_gather_object (hybrid mesh)", s.name):
            dist.all_gather_object(everyone, mine)
        replicas, shards = dist.get_world_size(s.config.replicate_group), dist.get_world_size(s.config.process_group)
        layout = torch.empty(replicas, shards, dtype=torch.int64)
        for i, j, g in everyone:
            layout[i, j] = g
        mesh = DeviceMesh.from_group([s.config.replicate_group, s.config.process_group], device_type, mesh=layout,
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


def uses_dtensor(unit: FullyShardedDataParallel, config: Any) -> bool:
    """As torch's FSDP1: DTensors when the unit was built from a ``device_mesh`` or the config asks
    (``_use_dtensor``), else ``ShardedTensor``s (see [Note: Sharded state dicts])."""
    return unit._unit_state.config.device_mesh_given or bool(getattr(config, "_use_dtensor", False))


def to_sharded(full: torch.Tensor, unit: FullyShardedDataParallel, use_dtensor: bool,
               offload_to_cpu: bool = False) -> DTensor | ShardedTensor | torch.Tensor:
    """A full tensor (the same on every rank of the unit) as this rank's chunk of a DTensor or a
    ShardedTensor (see ``uses_dtensor``); a scalar stays a plain tensor (it cannot be cut)."""
    if use_dtensor:
        return to_dtensor(full, unit, offload_to_cpu)
    if full.dim() == 0:
        tensor = full.detach().clone()
        return tensor.cpu() if offload_to_cpu else tensor
    return to_sharded_tensor(full.detach(), unit, offload_to_cpu)


def to_sharded_tensor(full: torch.Tensor, unit: FullyShardedDataParallel, offload_to_cpu: bool) -> ShardedTensor:
    """torch FSDP1's ShardedTensor of ``full``: ``full.chunk(W)`` over the unit's shard group, chunk r on
    group rank r (ranks past the last chunk hold no shard); made from every rank's own knowledge, no
    collective. (With hybrid sharding the replicas hold the same chunks; DCP keeps one copy.)"""
    group = unit._unit_state.config.process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks = full.chunk(world, dim=0)
    device = torch.device("cpu") if offload_to_cpu else full.device
    metadata, offset = [], 0
    for r, chunk in enumerate(chunks):
        metadata.append(ShardMetadata([offset] + [0] * (full.dim() - 1), list(chunk.shape),
                                      _placement(group, r, device)))
        offset += chunk.shape[0]
    local = [ShardedTensorShard(chunks[rank].clone().to(device), metadata[rank])] if rank < len(chunks) else []
    properties = TensorProperties(dtype=full.dtype, layout=full.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, sharded_tensor_metadata=ShardedTensorMetadata(metadata, full.shape, properties), process_group=group)


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
    use_dtensor = uses_dtensor(unit, config)
    entries: dict[str, Any] = {}
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    managed: set[int] = set()
    local = unit._unit_state.state_dict_type == StateDictType.LOCAL_STATE_DICT
    records: dict[str, dict[str, Any]] = {}  # LOCAL: each unit's layout record, by its path
    for u in fsdp_modules(unit):  # one unit's full parameters at a time
        if u._unit_state.handle is None:
            continue
        managed.add(id(u._unit_state.flat_param))
        if u._unit_state.config.use_orig_params:
            managed.update(id(p) for p in u._unit_state.orig_params)
        if local:
            entries[join(paths[id(u)], FLAT_PARAM)] = local_flat_shard(u, use_dtensor, config.offload_to_cpu)
            records[paths[id(u)]] = layout_record(u._unit_state)
            continue
        with summon_full_params(u, recurse=False, writeback=False, guard_phase=None):
            for m, attr, _ in u._unit_state.param_slots:
                full = m._parameters[attr]
                entries[join(paths[id(m)], attr)] = to_sharded(full, u, use_dtensor, config.offload_to_cpu)
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
    _add_layout_records(out, prefix, records)
    return out


def _add_layout_records(out: Any, prefix: str, records: dict[str, dict[str, Any]]) -> None:
    """LOCAL: each unit's layout record into its entry of the state dict's ``_metadata`` (see [Note: Local state
    dicts])."""
    if not records:
        return
    if getattr(out, "_metadata", None) is None:
        out._metadata = collections.OrderedDict()
    for path, record in records.items():
        out._metadata.setdefault(metadata_key(prefix, path), {})[LAYOUT_METADATA] = record


def metadata_key(prefix: str, path: str) -> str:
    """A module's entry in a state dict's ``_metadata``: its full name, as ``nn.Module.state_dict`` writes it."""
    return (prefix + path).rstrip(".") if path else prefix.rstrip(".")


def layout_record(s: UnitState) -> dict[str, Any]:
    """What a unit's flat order means, saved beside its LOCAL_STATE_DICT entry and checked on load."""
    layout = s.handle.layout
    return {"names": list(s.param_local_names), "shapes": [list(shape) for shape in layout.shapes],
            "dtype": str(s.flat_param.dtype), "numel": layout.unpadded_numel}


def local_flat_shard(unit: FullyShardedDataParallel, use_dtensor: bool, offload_to_cpu: bool) -> DTensor | ShardedTensor:
    """The unit's flat shard, without padding, as a 1-D DTensor (or, as torch's FSDP1 without a
    device_mesh, ShardedTensor; see ``uses_dtensor``) of the unpadded length."""
    dt = local_dtensor(unit, offload_to_cpu)
    s = unit._unit_state
    if use_dtensor or s.replicated:  # (a replicated unit's whole flat parameter: a replicated DTensor)
        return dt
    group, numel, local = s.config.process_group, dt.shape[0], dt.to_local()
    world, rank, size = dist.get_world_size(group), dist.get_rank(group), s.handle.layout.shard_numel
    metadata, mine = [], None
    for r in range(world):
        begin = min(r * size, numel)
        n = min(size, numel - begin)
        if n > 0:
            metadata.append(ShardMetadata([begin], [n], _placement(group, r, local.device)))
            if r == rank:
                mine = metadata[-1]
    local_shards = [ShardedTensorShard(local, mine)] if mine is not None else []
    properties = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=ShardedTensorMetadata(metadata, torch.Size([numel]), properties),
        process_group=group)


def _placement(group: dist.ProcessGroup, group_rank: int, device: torch.device) -> str:
    """A ShardedTensor shard's placement, as torch's FSDP1 writes it: ``rank:<global rank>/<device>``."""
    global_rank = dist.get_global_rank(group, group_rank)
    if device.type == "cpu":
        return f"rank:{global_rank}/cpu"
    return f"rank:{global_rank}/{device.type}:{global_rank % max(1, torch.cuda.device_count())}"


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
