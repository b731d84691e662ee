"""Full-parameter access between iterations: ``summon_full_params`` and ``apply``.

Each gathers what it needs through the same scheduler verbs as training
(unshard, wait, reshard) and leaves nothing unsharded behind.

[Note: Summoned buffers outlive the context]
Code inside ``summon_full_params`` keeps tensors that alias the full parameters:
``p.detach().cpu()`` (verl's LoRA and weight export, peft's state dicts) is a copy on a
GPU but the full buffer itself on a CPU. The runtime's unsharded buffer is freed in
place when a unit reshards (its storage resized to nothing, as torch's FSDP1 does,
so that tensors saved for backward do not keep it): such an alias would then read
freed memory and crash the process. So a sharded unit is summoned into a buffer of
its own (one all-gather, the same memory while the context lasts), which the
context only lets go of: without an alias it is freed on exit; an alias kept
outside keeps its values, as any torch tensor would.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _C, _orig_params, _rank_guard
from flatshard._common import FLAT_PARAM, UsageError, fsdp_modules, in_backward, is_unit
from flatshard._profiling import collective_range
from flatshard._backward import abort_backward
from flatshard._runtime import lazy_init, reshard
from flatshard._state import TrainingState, UnitState

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel

IDLE, SUMMONING = TrainingState.IDLE, TrainingState.SUMMONING


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
    guard_phase: str | None = "summon_full_params()",
    beyond_torch: bool = True,
) -> Iterator[None]:
    """See ``FullyShardedDataParallel.summon_full_params`` and [Note: Summoning]. ``guard_phase``: how
    the rank-divergence guard names the call (None: the caller ran the guard). ``beyond_torch``: allow
    the combinations torch's FSDP1 refuses (see ``check_as_torch``)."""
    if is_unit(module) and module._unit_state.config.dim0_layout:
        raise NotImplementedError(f"summon_full_params is FullyShardedDataParallel's; {type(module).__name__} was "
                                  f"sharded with fully_shard: call its unshard() and reshard(), as with torch's FSDP2.")
    tops = [module] if is_unit(module) else fsdp_modules(module, root_only=True)
    for top in tops:
        if top._unit_state.is_root is None:
            lazy_init(top)
    roots = list({id(r): r for r in (top._unit_state.root for top in tops)}.values())
    units = [u for u in (fsdp_modules(module) if recurse else tops) if u._unit_state.training_state is not SUMMONING]
    if in_backward() or any(root.in_forward_call for root in roots):
        raise UsageError(
            "Cannot manually unshard parameters during forward/backward: summon_full_params was called during "
            "forward or backward; call it between iterations (or before the forward whose parameters it should "
            "show)."
        )
    if not beyond_torch:
        check_as_torch(units, writeback, rank0_only, offload_to_cpu, with_grads)
    if guard_phase is not None and any(u._unit_state.handle is not None and not u._unit_state.handle.is_replicated
                                       for u in units):
        for root in roots:
            _rank_guard.check(root, guard_phase)
    for root in roots:
        if root.final_callback_queued:
            abort_backward(root)
    options = _Options(writeback, rank0_only, offload_to_cpu, with_grads)
    entered: list[_Summoned] = []
    try:
        for unit in units:
            entered.append(_expose_full_params(unit, options))
        yield
    finally:
        for summoned in reversed(entered):
            _hide_full_params(summoned, options)


def check_as_torch(units: list[FullyShardedDataParallel], writeback: bool, rank0_only: bool, offload_to_cpu: bool,
                   with_grads: bool) -> None:
    """What ``FullyShardedDataParallel.summon_full_params`` (torch's name) refuses, as torch's FSDP1 refuses
    it and with its messages; ``flatshard.summon_full_params`` does all of these (see [Note: Summoning])."""
    hint = " (torch's FSDP1 refuses it; flatshard.summon_full_params, with the same arguments, supports it)"
    for unit in units:
        s = unit._unit_state
        if s.handle is None:
            continue
        if with_grads and (offload_to_cpu or not s.config.use_orig_params):
            raise NotImplementedError(f"with_grads={with_grads}, use_orig_params={s.config.use_orig_params}, "
                                      f"offload_to_cpu={offload_to_cpu} is not supported yet{hint}")
        if offload_to_cpu and s.replicated:
            raise NotImplementedError(f"offload_to_cpu=True and NO_SHARD is not supported yet{hint}")
    if rank0_only and writeback:
        raise NotImplementedError(f"writeback=True and rank0_only=True is not supported yet{hint}")


# [Note: Summoning]
# Each unit's full flat parameter, in full precision, is made once ("the full
# buffer"): the gathered buffer itself when the unit computes in its shard's
# dtype and device, else a full-precision gather (gather_full_precision). The
# original parameters become views of it: new nn.Parameters registered on the
# modules (use_orig_params=False), or the original parameters themselves with
# that data (True). Options, as torch's FSDP1 defines them and for both
# settings of use_orig_params:
# - with_grads: the full gradient likewise (all-gathered, zeros where a rank
#   has none), as the parameters' .grad;
# - offload_to_cpu: the full buffers are copied to the host (and the device
#   copy freed at once);
# - rank0_only: only the group's first rank exposes them; the others take part
#   in the collectives and keep their sharded state;
# - writeback: on exit each rank copies its part of the full buffer (and
#   gradient) back into its shard; with rank0_only the first rank's buffers
#   are broadcast first.
# torch's FSDP1 refuses three of these combinations (rank0_only with writeback,
# offload_to_cpu with a NO_SHARD unit, with_grads with use_orig_params=False or
# offload_to_cpu): FullyShardedDataParallel.summon_full_params, torch's name,
# refuses them as torch does (check_as_torch); flatshard.summon_full_params is the
# same context without that check, the explicit opt-in to them.


@dataclasses.dataclass(frozen=True)
class _Options:
    writeback: bool
    rank0_only: bool
    offload_to_cpu: bool
    with_grads: bool


@dataclasses.dataclass
class _Summoned:
    unit: FullyShardedDataParallel
    full: torch.Tensor | None = None  # the full buffer the exposed parameters are views of
    grad: torch.Tensor | None = None  # the full gradient (with_grads), or None
    exposed: bool = False  # False on ranks other than the first with rank0_only
    has_grad: bool = False  # with_grads and some rank has a gradient (the same on every rank)
    params: list = dataclasses.field(default_factory=list)  # use_orig_params=False: the exposed Parameters
    flat: nn.Parameter | None = None  # use_orig_params=False: the flat parameter, unregistered meanwhile
    shard: torch.Tensor | None = None  # the flat parameter's own data (its shard), while it shows the full buffer


def _expose_full_params(unit: FullyShardedDataParallel, options: _Options) -> _Summoned:
    s = unit._unit_state
    summoned = _Summoned(unit)
    s.switch("summon")
    handle = s.handle
    if handle is None:
        return summoned
    if s.config.use_orig_params:
        _orig_params.writeback(s)
    # A replicated unit's buffer is its shard (edits stay); a sharded one's is gathered fresh, not into the
    # runtime's buffer: see [Note: Summoned buffers outlive the context].
    gathered_in_place = _computes_as_stored(s) and handle.is_replicated
    if gathered_in_place:
        s.root.scheduler.unshard(handle)
        s.root.scheduler.wait_for_unshard(handle)
        full = handle.unsharded
    else:  # full precision, on the compute device (see [Note: Mixed precision and offload])
        full = s.root.scheduler.gather_full_precision(handle)
    grad = _gather_full_grad(s) if options.with_grads else None
    summoned.has_grad = grad is not None
    summoned.exposed = not options.rank0_only or dist.get_rank(s.config.process_group) == 0
    if not summoned.exposed:
        if gathered_in_place:
            reshard(s)
        return summoned
    if options.offload_to_cpu and full.device.type != "cpu":
        full, grad = full.cpu(), (grad.cpu() if grad is not None else None)
        if gathered_in_place:
            reshard(s)
    summoned.full, summoned.grad = full, grad
    # The flat parameter shows the full values meanwhile, as torch's FSDP1's does (frameworks and torch's tests read
    # its numel() there): unpadded (with use_orig_params, where torch pads the flat parameter to the world size, with
    # that padding: see mark_flat_parameter's _numels_with_padding); its shard comes back at the context's end.
    summoned.shard = s.flat_param.data
    layout = handle.layout
    s.flat_param.data = full[: layout.padded_numel if s.config.use_orig_params else layout.unpadded_numel]
    views = _C.views_of(full, handle.layout)
    grads = _C.views_of(grad, handle.layout) if grad is not None else [None] * len(views)
    for m, attr, _ in s.param_slots:
        m.__dict__.pop(attr, None)
    s.placeholders_set = False  # the modules show the full parameters until the reshard at the context's end
    if s.config.use_orig_params:  # the registered parameters themselves show the full values
        with torch.no_grad():
            for p, v, g in zip(s.orig_params, views, grads):
                p.data = v
                _orig_params.set_grad(p, g if p.requires_grad else None)
        return summoned
    summoned.flat = unit._parameters.pop(FLAT_PARAM)
    summoned.params = [nn.Parameter(v, requires_grad=summoned.flat.requires_grad) for v in views]
    for p, g in zip(summoned.params, grads):
        p.grad = g
    for m, attr, index in s.param_slots:
        m._parameters[attr] = summoned.params[index]
    return summoned


def _gather_full_grad(s: UnitState) -> torch.Tensor | None:
    """The unit's full gradient on the compute device, zeros where a rank has none; None if no rank
    has one (collective over the unit's shard group)."""
    handle = s.handle
    flat = s.flat_param
    local = flat.grad
    any_grad = torch.tensor([0.0 if local is None else 1.0], device=s.device)
    with collective_range("summon_full_params all_reduce (any gradient)", s.name):
        dist.all_reduce(any_grad, op=dist.ReduceOp.MAX, group=s.config.process_group)
    if not any_grad.item():
        return None
    if handle.is_replicated and local is not None and local.device == s.device and local.dtype == flat.dtype:
        # The gradient itself, as the parameters are the shard itself: edits stay, writeback or not (as torch's
        # NO_SHARD).
        return local.detach()
    local = (torch.zeros_like(flat) if local is None else local.detach()).to(s.device, flat.dtype)
    if handle.is_replicated:
        return local.clone()
    full = local.new_empty(handle.layout.padded_numel)
    with collective_range("summon_full_params all_gather (gradient)", s.name):
        dist.all_gather_into_tensor(full, local.contiguous(), group=s.config.process_group)
    return full


def _hide_full_params(summoned: _Summoned, options: _Options) -> None:
    unit = summoned.unit
    s = unit._unit_state
    s.switch("end of summon")
    handle = s.handle
    if handle is None:
        return
    flat = summoned.flat if summoned.flat is not None else s.flat_param
    if summoned.shard is not None:
        s.flat_param.data = summoned.shard
    if summoned.exposed:
        if s.config.use_orig_params:
            with torch.no_grad():
                for p, v in zip(s.orig_params, _C.views_of(summoned.full, handle.layout)):
                    if options.writeback and p.data.data_ptr() != v.data_ptr():  # replaced inside the context
                        v.copy_(p.data.reshape(v.shape))
        else:
            views = _C.views_of(summoned.full, handle.layout)
            with torch.no_grad():
                for m, attr, index in s.param_slots:
                    p = m._parameters.pop(attr, None)
                    # replaced inside the context (e.g. .to(dtype)): its values, not the buffer's, are written back
                    if options.writeback and p is not None and p.data.data_ptr() != views[index].data_ptr():
                        views[index].copy_(p.data.reshape(views[index].shape))
            unit.register_parameter(FLAT_PARAM, flat)
    if options.writeback:
        _write_back(s, summoned, flat, options)
    # The Parameters shown inside the context are not the model's afterwards: they become empty (clone inside the
    # context to keep values; tensors that alias the buffer keep it, see [Note: Summoned buffers outlive the context]).
    for p in summoned.params:
        p.data = p.data.new_empty(0)
        p.grad = None
    reshard(s)
    if s.config.use_orig_params:
        _orig_params.use_sharded_views(s)
        _orig_params.use_grad_views(s)


@torch.no_grad()
def _write_back(s: UnitState, summoned: _Summoned, flat: nn.Parameter, options: _Options) -> None:
    """Each rank's part of the full buffer (and gradient) into its shard; see [Note: Summoning]."""
    handle = s.handle
    sources = [(summoned.full, flat)]
    if summoned.has_grad:
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)
        sources.append((summoned.grad, flat.grad))
    begin, end = handle.layout.shard_range(handle.rank)
    for full, target in sources:
        if options.rank0_only:
            buffer = (full.to(s.device) if summoned.exposed
                      else torch.empty(handle.layout.padded_numel, dtype=target.dtype, device=s.device))
            with collective_range("summon_full_params broadcast (rank0_only writeback)", s.name):
                dist.broadcast(buffer, src=dist.get_global_rank(s.config.process_group, 0), group=s.config.process_group)
            full = buffer
        target.copy_(full[begin:end])


def _computes_as_stored(s: UnitState) -> bool:
    """Whether the unsharded buffer holds the shard's own dtype on the shard's own device."""
    handle = s.handle
    return handle.param_dtype == s.flat_param.dtype and not handle.offload


def apply(unit: FullyShardedDataParallel, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
    """See ``FullyShardedDataParallel.apply``."""
    if unit._unit_state.training_state is SUMMONING:  # (torch's type and phrase: its apply asserts IDLE)
        raise ValueError(f"expected to be in states [<TrainingState.IDLE: 1>] but current state is "
                         f"TrainingState.SUMMON_FULL_PARAMS: FullyShardedDataParallel.apply summons the unit's full "
                         f"parameters itself; call it outside summon_full_params (or call nn.Module.apply there).")
    uninitialized = unit._unit_state.is_root is None
    with summon_full_params(unit, recurse=False, writeback=True):
        out = nn.Module.apply(unit, fn)
    if uninitialized:
        # Summoning made this unit a root; it may not be the real one (apply
        # on inner units before wrapping their parent): decide at the first forward.
        for u in fsdp_modules(unit):
            u._unit_state.drop_root()
    return out
