"""The activation term of a plan: measured from one plain forward and backward on one rank's batch.

[Note: Measuring activations]
What a model's forward saves for its backward depends on the model's code, the batch and the
dtype, not on flatshard: so the plan takes it from a measured step rather than a formula.
``measure_activations(model, loss_fn)`` runs ``loss_fn(model).backward()`` twice on the model
as it is (unwrapped, on the device it is on; cast to the compute dtype first when one is
given, as mixed precision computes), the first to let once-only allocations happen, and
returns the highest point of the second, above what was held before it, of the bytes that are
not gradients (the plan counts gradients itself, unit by unit as they are reduced): what the
forward saved for the backward, the loss's temporaries and the backward's own. (Not the
peak less all the gradients: a model whose gradients outweigh its activations peaks at the end
of its backward, where the activations are gone.) Both on CUDA and on a CPU the step's allocations come from torch's own records (the
profiler with ``profile_memory``; a CPU backward runs on the calling thread, so every tensor of
the step is seen); a block whose address ends as a parameter's ``.grad`` is a gradient from its
allocation on. The model must fit on one device: for a model that does not, measure a shallower one
of the same width (one and two layers) and extrapolate per layer, as the CLI's ``--batch-size``
does.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def measure_activations(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], *,
                        dtype: torch.dtype | None = None) -> int:
    """Bytes a forward and backward of ``model`` holds beyond its parameters and the gradients it makes (see
    [Note: Measuring activations]). ``loss_fn(model)`` returns the loss of one rank's batch. ``dtype``: the
    compute dtype (mixed precision's ``param_dtype``); the model's floating-point parameters are cast to it
    in place."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"flatshard.plan.measure_activations: model: expected an nn.Module but got "
                        f"{type(model).__name__}")
    if dtype is not None:
        model.to(dtype)
    params = list(model.parameters())
    if not params:
        raise ValueError("flatshard.plan.measure_activations: the model has no parameters")
    device = params[0].device

    def step() -> None:
        loss = loss_fn(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("flatshard.plan.measure_activations: loss_fn(model) must return the loss, a tensor of "
                            f"one element, but returned {type(loss).__name__}")
        loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"flatshard.plan.measure_activations: expected a model on a CPU or a CUDA device but it is "
                         f"on {device}")
    allocations = _allocations(step, device)
    grads = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    model.zero_grad(set_to_none=True)
    # The last allocation at a gradient's address is that gradient's (autograd hands its result to .grad).
    last_at = {ptr: i for i, (ptr, size) in enumerate(allocations) if size > 0}
    grad_events = {last_at[ptr] for ptr in grads if ptr in last_at}
    live: dict[int, int] = {}  # address: bytes, of the step's allocations other than gradients
    current = peak = 0
    for i, (ptr, size) in enumerate(allocations):
        if size > 0 and i not in grad_events:
            live[ptr] = size
            current += size
            peak = max(peak, current)
        elif size < 0:
            current -= live.pop(ptr, 0)  # (what was allocated before the step is not counted)
    return peak


def _allocations(step: Callable[[], None], device: torch.device) -> list[tuple[int, int]]:
    """(address, bytes: negative when freed) of every allocation and free of ``device``'s memory within
    ``step``, in time order (torch's allocation records)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    allocations = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        fields = event.extra_fields
        if event.tag == _EventType.Allocation and fields.device.type == device.type:
            allocations.append((event.start_time_ns, fields.id, fields.ptr, fields.alloc_size))
        pending.extend(event.children)
    allocations.sort(key=lambda a: (a[0], a[1]))
    return [(ptr, size) for _, _, ptr, size in allocations]
