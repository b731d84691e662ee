"""fully_shard over parameters that are DTensors already: tensor parallelism beneath FSDP.

[Note: Tensor-parallel parameters]
torchtitan, accelerate's ParallelismConfig and transformers' ``tp_plan`` shard a block's matrices over a TP mesh
first (``parallelize_module``: each such parameter a DTensor over the TP mesh, ``Shard(0)`` column-wise,
``Shard(1)`` row-wise, ``Replicate()`` for a row-wise bias or a norm), then call ``fully_shard(block,
mesh=world_mesh["dp"])``. As torch's FSDP2 does:
- FSDP shards each such parameter's *local* tensor (this rank's TP part) over the data-parallel mesh, on dim 0 or
  the dim ``shard_placement_fn`` gives (it sees the DTensor, as torch's): ``_fsdp2_config.take_tp_locals`` puts
  the local tensors on the modules in place of the DTensors before the construction, so the layout, the all-gather
  and the reduce-scatter are the plain path's, on TP-local shapes;
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

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
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


# [Note: Tensor-parallel parameters under torch.compile]
# torchtitan compiles each block after fully_shard. The wrapping below runs as it is, not traced (it makes graph
# inputs; torch's FSDP2 makes its unsharded parameters outside the graph too), and each wrapper is marked static
# where dynamo is loaded: dynamo keeps a parameter's shape static (force_parameter_static_shapes) but not the
# tensors inside a DTensor one, whose local tensors here are views of one unsharded buffer; a block compiled again
# for another shape (a second block of other widths) would otherwise make their sizes and offsets symbolic, and
# AOT autograd's handling of those aliased inputs then recursed without end (torch 2.13). Static, a block of
# another shape gets its own graph, as it does under torch's FSDP2.


@torch._disable_dynamo  # (see the note above, and [Note: Lazy dynamo] in _runtime.py)
def as_tp_dtensors(s: UnitState, views: list[torch.Tensor] | tuple) -> list[torch.Tensor]:
    """The unsharded views, those of TP parameters wrapped into DTensors over their TP mesh (see
    [Note: Tensor-parallel parameters])."""
    from torch.distributed.tensor import DTensor

    dynamo = sys.modules.get("torch._dynamo")  # (loaded by torch.compile; nothing traces before it is)
    out = list(views)
    for index, info in s.tp_params.items():
        view = out[index]
        out[index] = wrapped = DTensor.from_local(view, info.tp_mesh, info.tp_placements, run_check=False,
                                                  shape=info.shape, stride=info.stride)
        if dynamo is not None:
            dynamo.mark_static(wrapped)
    return out
