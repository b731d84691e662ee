"""fully_shard over parameters that are DTensors already: tensor parallelism beneath FSDP.

[Note: Tensor-parallel parameters]
torchtitan, transformers' ``DistributedConfig(tp_size=..., fsdp_size=...)`` and accelerate's ParallelismConfig shard
a block's matrices over a TP mesh first (``parallelize_module``: each such parameter a DTensor over the TP mesh,
``Shard(0)`` column-wise, ``Shard(1)`` row-wise, ``Replicate()`` for a row-wise bias or a norm), then call
``fully_shard(block, mesh=world_mesh["dp"])``. As torch's FSDP2 does:
- FSDP shards each such parameter's *local* tensor (this rank's TP part) over the data-parallel mesh, on dim 0 or
  the dim ``shard_placement_fn`` gives (it sees the DTensor, as torch's): ``_fsdp2_config.take_tp_locals`` puts
  the local tensors on the modules in place of the DTensors before the construction, so the layout, the all-gather
  and the reduce-scatter are the plain path's, on TP-local shapes;
- the sharded parameter is a DTensor over the mesh of both (the DP mesh's dims, then the TP mesh's), FSDP's
  placement first and the TP placement after: ``Shard(d)``, or ``_StridedShard(d, split_factor=TP size)`` where TP
  shards dim d too (this rank's rows are then not one range of the global rows), HSDP's ``Replicate()`` in front;
  each rank's local tensor is torch's;
- in forward and backward the module attribute is the unsharded TP-local view wrapped back into a DTensor over the
  TP mesh (``_TPView``, which autograd goes through): the block computes as it did with TP alone, and what reaches
  the view in backward is the local tensor of the gradient in the TP placement, which the runtime reduce-scatters
  over the DP mesh as any other gradient (a replicated parameter's ``Partial`` gradient: see [Note: Partial
  gradients of tensor-parallel parameters] below).
Refused by name: ``reshard_after_forward`` as an int (torch's FSDP2
refuses it too), a TP mesh of more than one dim, a parameter over the DP mesh itself without ``dp_mesh_dims`` (torch's
SPMD path: with it, such parameters go this way too, see [Note: torch's SPMD path] in _fsdp2_config.py), and a
``Partial`` parameter.
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
    dynamo = sys.modules.get("torch._dynamo")  # (loaded by torch.compile; nothing traces before it is)
    out = list(views)
    for index in s.tp_params:
        view = out[index]
        out[index] = wrapped = _TPView.apply(view, s, index)
        if dynamo is not None:
            dynamo.mark_static(wrapped)
    return out


# [Note: Partial gradients of tensor-parallel parameters]
# A parameter replicated over TP (a norm under sequence parallelism) gets a Partial gradient: each TP rank holds a
# part of the sum. torch's FSDP2 keeps it partial while it accumulates (a unit used twice in one backward, sums in
# the parameter's dtype; micro-batches without gradient sync, in the reduce dtype) and all-reduces it over the TP
# mesh once, when it reduces the unit. flatshard does the same: ``_TPView``'s backward hands such a gradient to the
# runtime as zeros and adds it to ``s.tp_partial`` instead; at the end of a backward that does not reduce, that sum
# goes into ``s.tp_partial_acc`` (reduce dtype); when the unit reduces (``reduce``), the sum is all-reduced over the
# TP mesh in the dtype it has then and added into the unit's unsharded gradient, before the reduce-scatter over the
# data-parallel mesh. A gradient already in the parameter's placements passes as it is; any other is redistributed
# to them, as ``DTensor.from_local``'s backward does.


class _TPView(torch.autograd.Function):
    """An unsharded view as the DTensor over its TP mesh it was before fully_shard (see the notes above)."""

    @staticmethod
    def forward(ctx, view: torch.Tensor, s: UnitState, index: int) -> torch.Tensor:  # type: ignore[override]
        from torch.distributed.tensor import DTensor

        ctx.s, ctx.index = s, index
        return DTensor(view.view_as(view), _spec(s, index, view.dtype), requires_grad=view.requires_grad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):  # type: ignore[override]
        if grad is None or not hasattr(grad, "_spec"):
            return grad, None, None
        s, index = ctx.s, ctx.index
        wanted = s.tp_params[index].tp_placements
        got = grad.placements
        local = grad._local_tensor
        if s.config.spmd is not None:  # (see [Note: torch's SPMD path] in _fsdp2_config.py)
            dp_indices = s.config.spmd[1]
            target = tuple(g if i in dp_indices else w for i, (g, w) in enumerate(zip(got, wanted)))
            return (local if target == got else grad.redistribute(placements=target)._local_tensor), None, None
        if got == wanted:
            return local, None, None
        if all(g == w or (w.is_replicate() and g.is_partial("sum")) for g, w in zip(got, wanted)):
            held = s.tp_partial.get(index)
            s.tp_partial[index] = local if held is None else held + local
            return torch.zeros_like(local), None, None
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        return redistribute_local_tensor(local, grad._spec, _spec(s, index, local.dtype)), None, None


def _spec(s: UnitState, index: int, dtype: torch.dtype) -> Any:
    """The DTensorSpec of parameter ``index``'s unsharded DTensor in ``dtype`` (made once: a spec costs ~0.3 ms)."""
    key = (index, dtype)
    spec = s.tp_specs.get(key)
    if spec is None:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        info = s.tp_params[index]
        spec = s.tp_specs[key] = DTensorSpec(info.tp_mesh, info.tp_placements,
                                             tensor_meta=TensorMeta(info.shape, info.stride, dtype))
    return spec


def has_partials(s: UnitState) -> bool:
    return bool(s.tp_partial or s.tp_partial_acc)


def end_backward(s: UnitState) -> None:
    """The unit's last use in a backward that does not reduce: this backward's partial sums into the accumulation,
    in the reduce dtype (see [Note: Partial gradients of tensor-parallel parameters])."""
    reduce_dtype = s.handle.reduce_dtype
    for index, part in s.tp_partial.items():
        held = s.tp_partial_acc.get(index)
        if held is None:
            s.tp_partial_acc[index] = part.to(reduce_dtype)
        else:
            held.add_(part)
    s.tp_partial.clear()


def reduce(s: UnitState) -> None:
    """The unit reduces now (after its C++ post-backward, which did not): its partial sums all-reduced over their TP
    meshes and added into its unsharded gradient; then the reduction (see [Note: Partial gradients of
    tensor-parallel parameters])."""
    import torch.distributed as dist

    summed = dict(s.tp_partial)
    for index, held in s.tp_partial_acc.items():  # (the last backward's part added into the accumulation)
        part = summed.get(index)
        summed[index] = held if part is None else held.add_(part)
    s.tp_partial.clear()
    s.tp_partial_acc.clear()
    groups: dict[tuple, list[int]] = {}  # one all-reduce per TP group and dtype
    for index, part in summed.items():
        groups.setdefault((id(s.tp_params[index].tp_mesh.get_group()), part.dtype), []).append(index)
    handle = s.handle
    grad = handle.take_unsharded_grad()
    for indices in groups.values():
        parts = [summed[i] for i in indices]
        flat = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(flat, group=s.tp_params[indices[0]].tp_mesh.get_group())
        for i, part in zip(indices, flat.split([p.numel() for p in parts])):
            _add_into_unsharded(handle, grad, i, part.view(summed[i].shape))
    handle.put_back_unsharded_grad(grad)
    s.root.scheduler.reduce_grad(handle)


def _add_into_unsharded(handle: Any, grad: torch.Tensor, index: int, full: torch.Tensor) -> None:
    """``full`` (parameter ``index``'s TP-local gradient) added into its places in the unit's unsharded flat gradient:
    each data-parallel rank's rows (or chunk along its shard dim) at that rank's segment, at the parameter's offset.
    A segment is a rank's shard, or with frozen parameters its trainable prefix (see [Note: Trainable prefix] in
    csrc/flatshard/flat_param.h: the trainable parameters come first, at the same offsets). (The C++
    ``accumulate_grad`` lays gradients out so too, but into the param-dtype sum of the current backward: an
    accumulation across micro-batches, all-reduced in the reduce dtype, must land in the reduce-dtype sum unrounded.)"""
    layout = handle.layout
    prefix = handle.reduce_prefix
    segment = prefix if prefix >= 0 and layout.shard_factor > 1 else layout.shard_numel
    offset, dim = layout.offsets[index], layout.shard_dims[index]
    for r in range(layout.shard_factor):
        if dim == 0:
            rows = layout.rows_of_rank(index, r)
            if rows <= 0:
                continue
            piece = full.narrow(0, r * layout.rows_per_shard(index), rows)
        else:
            piece = full.chunk(layout.shard_factor, dim)[r]
        grad.narrow(0, r * segment + offset, piece.numel()).view(piece.shape).add_(piece)


def drop(s: UnitState) -> None:
    """A backward that raised: its partial sums go with the unit's other gradients."""
    s.tp_partial.clear()
    s.tp_partial_acc.clear()
