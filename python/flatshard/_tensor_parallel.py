"""fully_shard over parameters that are DTensors already: tensor parallelism beneath FSDP.

[Note: Tensor-parallel parameters]
torchtitan, accelerate's ParallelismConfig and transformers' ``tp_plan`` shard a block's matrices over a TP mesh
first (``parallelize_module``: each such parameter a DTensor over the TP mesh, ``Shard(0)`` column-wise,
``Shard(1)`` row-wise, ``Replicate()`` for a row-wise bias or a norm), then call ``fully_shard(block,
mesh=world_mesh["dp"])``. As torch's FSDP2 does:
- FSDP shards each such parameter's *local* tensor (this rank's TP part) over the data-parallel mesh, on dim 0 or
  the dim ``shard_placement_fn`` gives (it sees the DTensor, as torch's): ``take_local`` puts the local tensors on
  the modules in place of the DTensors before the construction, so the layout, the all-gather and the
  reduce-scatter are the plain path's, on TP-local shapes;
- the sharded parameter is a DTensor over the mesh of both (the DP mesh's dims, then the TP mesh's), FSDP's
  placement first and the TP placement after: ``Shard(d)``, or ``_StridedShard(d, split_factor=TP size)`` where TP
  shards dim d too (this rank's rows are then not one range of the global rows), HSDP's ``Replicate()`` in front;
  each rank's local tensor is torch's;
- in forward and backward the module attribute is the unsharded TP-local view wrapped back into a DTensor over the
  TP mesh (``DTensor.from_local``, which autograd goes through): the block computes as it did with TP alone, and
  what reaches the view in backward is the local tensor of the gradient in the TP placement (a replicated
  parameter's ``Partial`` gradient all-reduced over the TP mesh by from_local's backward, as torch's FSDP2
  redistributes it), which the runtime reduce-scatters over the DP mesh as any other gradient.
Refused by name: ``reshard_after_forward`` as an int (torch's FSDP2
refuses it too), a TP mesh of more than one dim, a parameter over the DP mesh itself (torch's SPMD path, which needs
``dp_mesh_dims``), and a ``Partial`` parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from torch import nn

from flatshard._common import OWNER_ATTR

if TYPE_CHECKING:
    from flatshard._config import UnitConfig
    from flatshard._state import UnitState


class TPParam(NamedTuple):
    """What fully_shard keeps of a parameter that was a DTensor over a TP mesh."""

    tp_mesh: Any  # the DeviceMesh it was a DTensor over
    tp_placements: tuple  # its placements there
    shape: torch.Size  # its global shape
    stride: tuple[int, ...]  # and stride
    mesh: Any  # the sharded parameter's mesh: the DP mesh's dims, then the TP mesh's
    placements: tuple  # the sharded parameter's placements over it
    dim: int  # the dim of the local tensor FSDP shards (0 unless shard_placement_fn said otherwise)


def _is_dtensor(p: Any) -> bool:
    return hasattr(p, "_spec") and hasattr(p, "_local_tensor")


def take_local(modules: list[nn.Module], config: UnitConfig, reshard_after_forward: Any,
               shard_placement_fn: Callable | None) -> dict[int, TPParam]:
    """See [Note: Tensor-parallel parameters]: the DTensor parameters the unit of ``modules`` (configured as
    ``config``) will manage are replaced on every module registering them by an ``nn.Parameter`` of their local tensor
    (a tied one by one parameter); returns {id of that parameter: what it was}. Every refusal is made before anything
    is replaced."""
    ignored = config.ignored_params
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for unit_module in modules:
        for name, p in unit_module.named_parameters(remove_duplicate=True):
            if p in ignored or getattr(p, OWNER_ATTR, None) is not None or not _is_dtensor(p):
                continue
            found.setdefault(id(p), (name, p))
    if not found:
        return {}
    taken: dict[int, TPParam] = {}
    replacement: dict[int, nn.Parameter] = {}
    for name, p in found.values():
        info = _describe(name, p, config, reshard_after_forward if config.post_forward_group is not None else None,
                         shard_placement_fn)
        local = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
        replacement[id(p)] = local
        taken[id(local)] = info
    for unit_module in modules:
        for m in unit_module.modules():
            for attr, p in list(m._parameters.items()):
                if p is not None and id(p) in replacement:
                    m._parameters[attr] = replacement[id(p)]
    return taken


def _describe(name: str, p: Any, config: UnitConfig, reshard_after_forward: Any,
              shard_placement_fn: Callable | None) -> TPParam:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from flatshard._fsdp2_config import shard_dims

    dp_mesh = config.mesh
    spec = p._spec
    tp_mesh, tp_placements = spec.mesh, tuple(spec.placements)
    where = f"fully_shard: parameter '{name}' is a DTensor over {tp_mesh}"
    dp_names = set(dp_mesh.mesh_dim_names or ())
    if tp_mesh is dp_mesh or (tp_mesh.mesh_dim_names and dp_names & set(tp_mesh.mesh_dim_names)):
        raise NotImplementedError(f"{where}, which shares a dim with fully_shard's mesh {dp_mesh} (torch's SPMD path, "
                                  f"dp_mesh_dims): flatshard supports a parameter over a TP mesh separate from the DP "
                                  f"mesh only, as parallelize_module(block, world_mesh['tp'], plan) then "
                                  f"fully_shard(block, mesh=world_mesh['dp']) make.")
    if tp_mesh.ndim != 1:
        raise NotImplementedError(f"{where} of {tp_mesh.ndim} dims: flatshard's fully_shard supports tensor "
                                  f"parallelism over a 1-D mesh beneath it (no EP+TP yet).")
    if not all(isinstance(pl, (Shard, Replicate)) for pl in tp_placements):
        raise NotImplementedError(f"{where} with placements {tp_placements}: fully_shard takes parameters sharded "
                                  f"(Shard) or replicated (Replicate) over their TP mesh, not partial ones.")
    if reshard_after_forward is not None:  # (an int N below the shard group's size)
        raise NotImplementedError(f"{where}: resharding to a smaller mesh after forward (reshard_after_forward="
                                  f"{reshard_after_forward}) is not supported for DTensor parameters, by torch's "
                                  f"FSDP2 either; pass True or False.")
    if tp_mesh.device_type != dp_mesh.device_type:
        raise ValueError(f"{where} on {tp_mesh.device_type}, fully_shard's mesh is on {dp_mesh.device_type}")
    # As torch's: shard_placement_fn sees the DTensor; the dim is of its local tensor, which must divide by the
    # shard group's size where it is not 0.
    dim = 0 if shard_placement_fn is None else shard_dims(lambda _local: shard_placement_fn(p), dp_mesh,
                                                             [p._local_tensor], [name], config.world_size)[0]
    split = 1  # (how many TP shards this dim is cut into: FSDP's chunks of a local tensor are strided globally)
    for pl, size in zip(tp_placements, tp_mesh.shape):
        if isinstance(pl, Shard) and pl.dim == dim:
            split *= size
    fsdp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    dp_placements = (fsdp,) if dp_mesh.ndim == 1 else (Replicate(), fsdp)
    mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    return TPParam(tp_mesh, tp_placements, spec.shape, tuple(spec.stride), mesh, dp_placements + tp_placements, dim)


def as_tp_dtensors(s: UnitState, views: list[torch.Tensor] | tuple) -> list[torch.Tensor]:
    """The unsharded views, those of TP parameters wrapped into DTensors over their TP mesh (see
    [Note: Tensor-parallel parameters])."""
    from torch.distributed.tensor import DTensor

    out = list(views)
    for index, info in s.tp_params.items():
        view = out[index]
        out[index] = DTensor.from_local(view, info.tp_mesh, info.tp_placements, run_check=False, shape=info.shape,
                                        stride=info.stride)
    return out
