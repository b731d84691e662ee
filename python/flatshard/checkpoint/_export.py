"""Streaming full-weight export: ``stream_full_weights``.

[Note: Streaming export]
An RL trainer pushes its weights into an inference engine every step, and an export
to HF ``save_pretrained`` / safetensors wants full tensors; a FULL state dict makes a
full copy of the model on every rank (or rank 0) first. ``stream_full_weights``
gathers one unit at a time and yields that unit's parameters (copies, optionally
cast and moved) before gathering the next, so the extra memory is the largest unit's
full parameters plus the tensor the caller holds. Then come the buffers and the
parameters no unit manages, as a FULL state dict has them. It is a collective
generator: every rank of every unit's group must run it to the end, in the same
order (with ``rank0_only`` the other ranks' loops run with nothing yielded).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard._common import clean_name, fsdp_modules, join
from flatshard._full_params import summon_full_params
from flatshard._mixed_precision import original_buffer_dtypes

__all__ = ["stream_full_weights"]


def stream_full_weights(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    rank0_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(original name, full tensor)`` for every parameter and buffer of ``model``, gathering
    one unit at a time (see [Note: Streaming export]).

    ``dtype`` casts floating-point tensors; ``device`` moves them (e.g. ``"cpu"``);
    ``rank0_only`` yields on rank 0 only. Collective: every rank must exhaust the iterator.
    """
    units = fsdp_modules(model)
    if not units:
        raise ValueError("flatshard.checkpoint.stream_full_weights: expected a model with FSDP units but found none")
    keep = not rank0_only or dist.get_rank() == 0

    def out(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.detach().to(device=device if device is not None else t.device, dtype=cast, copy=True)

    paths = {id(m): clean_name(path) for path, m in model.named_modules()}
    managed: set[int] = set()
    seen: set[str] = set()
    for unit in units:
        if unit._unit_state.handle is None:
            continue
        with summon_full_params(unit, recurse=False, writeback=False):
            for m, attr, _ in unit._unit_state.param_slots:
                param = m._parameters[attr]
                managed.add(id(param))
                name = join(paths[id(m)], attr)
                if keep and name not in seen:
                    seen.add(name)
                    yield name, out(param)
        managed.add(id(unit._unit_state.flat_param))
        managed.update(id(p) for p in getattr(unit, "_orig_params", ()))
    buffer_dtypes = original_buffer_dtypes(model)
    if not keep:
        return
    for module_path, m in model.named_modules():
        for attr, value in list(m._parameters.items()) + [(b, m._buffers[b]) for b in m._buffers
                                                          if b not in m._non_persistent_buffers_set]:
            if value is None or id(value) in managed:
                continue
            name = join(clean_name(module_path), attr)
            if name in seen:
                continue
            seen.add(name)
            value = value.detach().to(buffer_dtypes.get(id(value), value.dtype))
            yield name, out(value)
