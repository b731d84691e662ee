"""``clip_grad_norm_``: the gradient norm over every rank's shards, and the clipping."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flatshard import _orig_params, _rank_guard
from flatshard._profiling import collective_range
from flatshard._runtime import require_root

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel


@torch.no_grad()
def clip_grad_norm(unit: FullyShardedDataParallel, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
    """See ``FullyShardedDataParallel.clip_grad_norm_``."""
    root = require_root(unit, "`clip_grad_norm_()` should only be called on the root FSDP instance")
    top = unit._unit_state
    _rank_guard.check(root, "clip_grad_norm_()")
    norm_type = float(norm_type)
    sharded, replicated = [], []
    managed = set()
    for u in root.units:
        s = u._unit_state
        if s.handle is None:
            continue
        managed.add(id(s.flat_param))
        if s.config.use_orig_params:  # gradients as the user left them, into the flat gradient
            _orig_params.writeback(s)
            managed.update(id(p) for p in s.orig_params)
        if s.flat_param.grad is not None:
            (replicated if s.handle.is_replicated else sharded).append(s.flat_param.grad)
    replicated += [p.grad for p in unit.parameters() if id(p) not in managed and p.grad is not None]
    grads = sharded + replicated
    if not grads and root.sharded_handles:  # as torch's FSDP1 (frameworks filter on this text)
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {top.config.rank} with no gradients -- returning the total "
                      f"norm in the default dtype {torch.float32}", stacklevel=3)
    dtype = grads[0].dtype if grads else torch.float32
    for g in grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)

    def local(gs: list[torch.Tensor]) -> torch.Tensor:
        # On the compute device: the collective needs it there (offloaded gradients are on the host).
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(top.device) for g in gs]
        if not norms:
            return torch.zeros((), device=top.device)
        norms = torch.stack(norms)
        return norms.max() if norm_type == math.inf else (norms**norm_type).sum()

    shard_part, replicated_part = local(sharded), local(replicated)
    with collective_range("clip_grad_norm_ all_reduce"):
        if norm_type == math.inf:
            dist.all_reduce(shard_part, op=dist.ReduceOp.MAX, group=top.config.process_group)
            total = torch.maximum(shard_part, replicated_part)
        else:
            dist.all_reduce(shard_part, group=top.config.process_group)
            total = (shard_part + replicated_part) ** (1.0 / norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total.to(dtype)
