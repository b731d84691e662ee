"""Rank 0's state dict on every rank (``broadcast_from_rank0``, FULL optimizer state dicts with ``rank0_only``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from flatshard._profiling import collective_range


def broadcast_from_rank0(state: Any, caller: str) -> Any:
    """Rank 0's ``state`` (a nested dict or list of tensors and values; other ranks pass anything) on every rank:
    its structure and the values that are not tensors pickled in one small message, then each tensor broadcast on
    its own, on the default group's device, so that no rank holds the whole state pickled in one buffer. Every
    rank gets CPU tensors (rank 0 its own where they are on the CPU). Collective on the default group; ``caller`` names the
    profiler ranges."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    leaves, spec = pytree.tree_flatten(state) if rank == 0 else ([], None)
    box = [([("tensor", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("value", t) for t in leaves],
            pytree.treespec_dumps(spec)) if rank == 0 else None]
    with collective_range(f"{caller} broadcast_object_list (rank 0's structure)"):
        dist.broadcast_object_list(box, src=0)
    described, spec_text = box[0]
    out = []
    for i, (kind, *rest) in enumerate(described):
        if kind == "value":
            out.append(rest[0])
            continue
        shape, dtype = rest
        tensor = leaves[i].detach().to(device) if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        with collective_range(f"{caller} broadcast"):
            dist.broadcast(tensor, src=0)
        out.append(leaves[i].detach().cpu() if rank == 0 else tensor.cpu())
    return pytree.tree_unflatten(out, pytree.treespec_loads(spec_text))
