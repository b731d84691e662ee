"""Full-parameter access between iterations: ``summon_full_params``, ``apply``, ``clip_grad_norm_``.

Each gathers what it needs through the same scheduler verbs as training
(unshard, wait, reshard) and leaves nothing unsharded behind.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _C, _orig_params
from flatshard._common import FLAT_PARAM, UsageError, fsdp_modules, in_backward, is_unit
from flatshard._runtime import abort_backward, reshard


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """See ``FullyShardedDataParallel.summon_full_params``."""
    for arg, value in (("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu), ("with_grads", with_grads)):
        if value:
            raise NotImplementedError(
                f"summon_full_params: {arg}=True is not implemented in flatshard yet."
            )
    roots = [module] if is_unit(module) else fsdp_modules(module, root_only=True)
    for root in roots:
        if root._is_root is None:
            root._lazy_init()
    units = fsdp_modules(module) if recurse else roots
    units = [u for u in units if not u._in_summon]
    if in_backward() or any(root._in_iteration and not root._final_callback_queued and _in_forward(root)
                            for root in roots):
        raise UsageError(
            "summon_full_params: called during forward or backward; call it between iterations (or before "
            "the forward whose parameters it should show)."
        )
    for root in roots:
        if root._final_callback_queued:
            abort_backward(root)
    entered: list[tuple[Any, list[nn.Parameter]]] = []
    try:
        for unit in units:
            entered.append((unit, _expose_full_params(unit)))
        yield
    finally:
        for unit, full in reversed(entered):
            _hide_full_params(unit, full, writeback)


def _in_forward(root: Any) -> bool:
    """Whether a unit of ``root`` is unsharded for a forward under way (its views handed out)."""
    return any(u._handle is not None and not u._placeholders_set and not u._in_summon for u in root._units)


def _expose_full_params(unit: Any) -> list[nn.Parameter]:
    unit._in_summon = True
    handle = unit._handle
    if handle is None:
        return []
    if unit._use_orig_params:
        _orig_params.writeback(unit)
    if _computes_as_stored(unit):
        unit._scheduler.unshard(handle)
        unit._scheduler.wait_for_unshard(handle)
        views = handle.views()
    else:  # full precision, on the compute device (see [Note: Mixed precision and offload])
        summoned = unit._scheduler.gather_full_precision(handle)
        unit.__dict__["_summoned_full"] = summoned
        views = _C.views_of(summoned, handle.layout)
    if unit._use_orig_params:  # the registered parameters themselves show the full values
        for m, attr, _ in unit._param_slots:
            m.__dict__.pop(attr, None)
        with torch.no_grad():
            for p, v in zip(unit._orig_params, views):
                p.data = v
        return []
    flat = unit._parameters.pop(FLAT_PARAM)
    full = [nn.Parameter(v, requires_grad=flat.requires_grad) for v in views]
    for m, attr, index in unit._param_slots:
        m.__dict__.pop(attr, None)
        m._parameters[attr] = full[index]
    unit.__dict__["_summoned_flat_param"] = flat
    return full


def _hide_full_params(unit: Any, full: list[nn.Parameter], writeback: bool) -> None:
    unit._in_summon = False
    handle = unit._handle
    if handle is None:
        return
    if unit._use_orig_params:
        flat = unit._flat_param
        full_buffer = unit.__dict__.get("_summoned_full", handle.unsharded)
        with torch.no_grad():
            for p, v in zip(unit._orig_params, _C.views_of(full_buffer, handle.layout)):
                if writeback and p.data.data_ptr() != v.data_ptr():  # data replaced inside the context
                    v.copy_(p.data.reshape(v.shape))
    else:
        flat = unit.__dict__.pop("_summoned_flat_param")
        for m, attr, _ in unit._param_slots:
            m._parameters.pop(attr, None)
        unit.register_parameter(FLAT_PARAM, flat)
    summoned = unit.__dict__.pop("_summoned_full", None)
    if writeback:
        begin, end = handle.layout.shard_range(handle.rank)
        with torch.no_grad():
            flat.copy_((handle.unsharded if summoned is None else summoned)[begin:end])
    # Parameters a caller kept from inside the context must not read freed
    # storage: they become empty (clone inside the context to keep values).
    for p in full:
        p.data = p.data.new_empty(0)
    reshard(unit)
    if unit._use_orig_params:
        _orig_params.use_sharded_views(unit)


def _computes_as_stored(unit: Any) -> bool:
    """Whether the unsharded buffer holds the shard's own dtype on the shard's own device."""
    handle = unit._handle
    return handle.param_dtype == unit._flat_param.dtype and not handle.offload


def apply(unit: Any, fn: Callable[[nn.Module], None]) -> Any:
    """See ``FullyShardedDataParallel.apply``."""
    uninitialized = unit._is_root is None
    with summon_full_params(unit, recurse=False, writeback=True):
        out = nn.Module.apply(unit, fn)
    if uninitialized:
        # Summoning made this unit a root; it may not be the real one (apply
        # on inner units before wrapping their parent): decide at the first forward.
        for _, u in unit.named_modules():
            if is_unit(u):
                u._is_root = None
                u.__dict__["_root"] = None
                u._scheduler = None
                u._units = []
    return out


@torch.no_grad()
def clip_grad_norm(root: Any, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
    """See ``FullyShardedDataParallel.clip_grad_norm_``."""
    if root._is_root is None:
        root._lazy_init()
    if not root._is_root:
        raise RuntimeError(
            f"FullyShardedDataParallel.clip_grad_norm_: expected the root unit but '{root._unit_name}' "
            f"is nested; call it on the outermost FSDP module."
        )
    norm_type = float(norm_type)
    sharded, replicated = [], []
    managed = set()
    for unit in root._units:
        if unit._handle is None:
            continue
        managed.add(id(unit._flat_param))
        if unit._use_orig_params:  # gradients as the user left them, into the flat gradient
            _orig_params.writeback(unit)
            managed.update(id(p) for p in unit._orig_params)
        if unit._flat_param.grad is not None:
            (replicated if unit._handle.is_replicated else sharded).append(unit._flat_param.grad)
    replicated += [p.grad for p in root.parameters() if id(p) not in managed and p.grad is not None]
    grads = sharded + replicated
    dtype = grads[0].dtype if grads else torch.float32
    for g in grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)

    def local(gs: list[torch.Tensor]) -> torch.Tensor:
        # On the compute device: the collective needs it there (offloaded gradients are on the host).
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(root._device) for g in gs]
        if not norms:
            return torch.zeros((), device=root._device)
        norms = torch.stack(norms)
        return norms.max() if norm_type == math.inf else (norms**norm_type).sum()

    shard_part, replicated_part = local(sharded), local(replicated)
    if norm_type == math.inf:
        dist.all_reduce(shard_part, op=dist.ReduceOp.MAX, group=root._process_group)
        total = torch.maximum(shard_part, replicated_part)
    else:
        dist.all_reduce(shard_part, group=root._process_group)
        total = (shard_part + replicated_part) ** (1.0 / norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total.to(dtype)
