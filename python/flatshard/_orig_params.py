"""``use_orig_params=True``: the original parameters stay the module's ``nn.Parameter`` s.

[Note: Original parameters]
As torch's FSDP1 with ``use_orig_params=True``:
- Every original parameter stays registered on its module (same object, so an
  optimizer built from ``model.parameters()`` or ``named_parameters()``, with
  groups chosen by name, holds them). The flat parameter is not registered:
  it lives on the unit as ``_flat_param`` for the runtime.
- Between iterations a parameter's data is this rank's part of it in the
  local flat shard: a 1-D view, possibly empty (sharded units), or the whole
  parameter in its own shape (units of shard factor 1). An optimizer step on
  it updates the flat shard in place; the next all-gather sends the update.
- In forward and backward the module attribute is the unsharded view (an
  autograd view of the gathered buffer), which shadows the registered
  parameter through the module's ``__dict__``; resharding removes the shadow.
- After backward each parameter's ``.grad`` is the matching view of the
  gradient shard; a parameter that took no part in this iteration's backward,
  or does not require grad, keeps ``.grad = None``.
- Before an iteration (and before summoning, clipping or saving optimizer
  state) what the user did in between is written back (``writeback``): a
  parameter whose data was replaced is copied into the shard; at the start of
  each backward, gradients set to None (``zero_grad``) clear the flat gradient,
  replaced gradients are copied into it (see [Note: A gradient set to None is
  freed]).
- Frozen and trainable parameters may share a unit: the frozen ones' views
  are not differentiable and they get no ``.grad``. The trainable ones come
  first in the flat order, and a sharded unit reduces only that prefix of its
  gradient (torch's FSDP1 reduces the frozen span's zeros too): see
  [Note: Trainable prefix] in csrc/flatshard/flat_param.h. A unit of shard
  factor 1, or one with a communication hook, reduces the whole gradient.

[Note: A gradient set to None is freed]
torch's FSDP2 frees a gradient when ``zero_grad()`` sets ``.grad`` to None:
between steps (evaluation, an RL loop's generation) a rank holds no gradient
memory. fully_shard's ``.grad`` s are views of one gradient shard per unit, so
after a backward the unit lets go of that shard (``flat_param.grad = None``)
and the views alone keep it alive (each view holds its base); what
``use_grad_views`` records of them (``orig_grads_given``) is weak references.
Setting every ``.grad`` of the unit to None frees the shard then. The class
keeps holding it, as torch's FSDP1 does.

What the user did to the gradients is written back (``write_back_grads``) at
the start of every backward, before any reduction adds into ``flat_param.grad``:
- every ``.grad`` still the view it was given: the shard is ``flat_param.grad``
  again, and the backward adds into it (torch's adds into ``.grad``);
- every one None (a ``zero_grad``, also one between the forward and the
  backward, or between two backwards through a kept graph): the backward starts
  from none;
- some None or replaced: the None ones zeroed, the replaced ones copied in, in
  the shard they were given from where it lives (one shard, not two), unless one
  set to None or replaced still lives (the script holds it, and torch's leaves
  it as it is): then in a new one.
At the end of a reduced backward a parameter gets a ``.grad`` if it got a
gradient in a backward since the last one (``orig_grad_seen``: also in no_sync
micro-batches, whatever was zeroed between) or holds one from before
(``orig_grad_held``, which ``write_back_grads`` keeps: False once set to None).
Whatever reads ``flat_param.grad`` between steps (the class's
``clip_grad_norm_``, summoning, moving or casting the shards) writes back
first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from weakref import ref

import torch
from torch import nn

from flatshard import _C, _dtensor_params

if TYPE_CHECKING:
    from flatshard._state import UnitState


def sharded_views(s: UnitState) -> list[torch.Tensor]:
    """Each original parameter's data between iterations (see the note)."""
    handle = s.handle
    flat = s.flat_param.detach()
    layout = handle.layout
    if handle.is_replicated:
        return _C.views_of(flat, layout)
    views = [flat.new_empty(0) for _ in range(layout.num_params)]
    for index, _offset_in_param, offset_in_shard, numel in layout.shard_slices(handle.rank):
        views[index] = flat[offset_in_shard : offset_in_shard + numel]
    return views


def init(s: UnitState, params: list[nn.Parameter]) -> None:
    """At wrap time: the original parameters become views of the local shard."""
    if s.config.dim0_layout:  # fully_shard: see [Note: DTensor parameters] in _dtensor_params.py
        _dtensor_params.init(s, params)
        return
    s.orig_params = params
    s.orig_grad_seen = [False] * len(params)
    s.orig_grad_held = [False] * len(params)
    use_sharded_views(s)


def use_sharded_views(s: UnitState) -> None:
    if s.config.dim0_layout:
        _dtensor_params.use_sharded_views(s)
        return
    with torch.no_grad():
        for p, view in zip(s.orig_params, sharded_views(s)):
            p.data = view


def _grad_targets(s: UnitState, flat_grad: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(param index, its piece of ``flat_grad``) for each parameter with elements in this rank's shard: 1-D, or
    in its own shape for a replicated unit; fully_shard's: its rows (see [Note: DTensor parameters])."""
    handle = s.handle
    layout = handle.layout
    if s.config.dim0_layout:
        return list(enumerate(_dtensor_params.local_views(s, flat_grad)))
    if handle.is_replicated:
        return [(i, flat_grad[layout.offsets[i] : layout.offsets[i] + layout.numels[i]].view(layout.shapes[i]))
                for i in range(layout.num_params)]
    return [(index, flat_grad[offset_in_shard : offset_in_shard + numel])
            for index, _offset_in_param, offset_in_shard, numel in layout.shard_slices(handle.rank)]


def use_grad_views(s: UnitState, ends_accumulation: bool = False) -> None:
    """After backward: each parameter's ``.grad`` is its view of the gradient shard (a DTensor over it for
    fully_shard's): each one that got a gradient since the last reduced backward (``orig_grad_seen``), or held one
    (``orig_grad_held``: its values are in the shard, see ``write_back_grads``). ``ends_accumulation``: the end of a
    reduced backward, after which ``orig_grad_seen`` starts again."""
    flat_grad = s.flat_param.grad
    params = s.orig_params
    s.orig_grads_given = None
    if flat_grad is not None and s.config.dim0_layout and flat_grad.dtype == s.flat_param.dtype:
        s.orig_grads_given = _dtensor_params.use_grad_views(s, flat_grad)
        if s.orig_grads_given is not None:  # see [Note: A gradient set to None is freed]
            s.flat_param.grad = None
        if ends_accumulation:
            s.orig_grad_seen = [False] * len(params)
        return
    given = [seen or held for seen, held in zip(s.orig_grad_seen, s.orig_grad_held)]
    if ends_accumulation:
        s.orig_grad_seen = [False] * len(params)
    for p in params:
        p.grad = None
    if flat_grad is None:
        s.orig_grad_held = [False] * len(params)
        return
    as_dtensor = s.config.dim0_layout
    # (The class's: a parameter with no element on this rank keeps None, as torch's FSDP1; fully_shard's get a
    # DTensor with an empty local tensor, as torch's FSDP2.)
    for index, view in _grad_targets(s, flat_grad):
        p = params[index]
        if p.requires_grad and given[index]:
            set_grad(p, _dtensor_params.on_spec_of(p, view) if as_dtensor else view)
    s.orig_grad_held = [p.grad is not None for p in params]
    given = [(None if p.grad is None else ref(p.grad), _data_ptr(p.grad, as_dtensor)) for p in params]
    if any(grad is not None for grad, _ in given):  # (none given: writeback's own check clears the flat gradient)
        s.orig_grads_given = (ref(flat_grad), given)


def hand_out_grads(s: UnitState) -> list[torch.Tensor]:
    """The end of a reduced backward for ``s``'s parameters: their ``.grad`` s (``use_grad_views``); returns
    fully_shard's parameters whose post-accumulate-grad hooks are to run now (see [Note: Post-accumulate-grad hooks] in
    _dtensor_params.py)."""
    got = s.orig_grad_seen  # (use_grad_views starts a new list)
    use_grad_views(s, ends_accumulation=True)
    return _dtensor_params.hooked_params(s, got) if s.config.dim0_layout else []


def _data_ptr(grad: torch.Tensor | None, as_dtensor: bool) -> int:
    if grad is None:
        return 0
    return (_dtensor_params.local_of(grad) if as_dtensor else grad).data_ptr()


def _grads_as_given(s: UnitState, flat: torch.Tensor) -> bool:
    """Whether every parameter's ``.grad`` is still what ``use_grad_views`` gave it, on the same memory, and the flat
    gradient the same: what was done to them since was done in place, on the flat gradient (the common case, an
    optimizer's step and in-place clipping: writeback's check per parameter costs a fraction of a microsecond). Then
    the flat gradient is ``flat.grad`` again (see [Note: A gradient set to None is freed])."""
    given = s.orig_grads_given
    if given is None:
        return False
    flat_grad = given[0]()
    if flat_grad is None or (flat.grad is not None and flat.grad is not flat_grad):
        return False
    as_dtensor = s.config.dim0_layout
    for p, (grad_ref, ptr) in zip(s.orig_params, given[1]):
        grad = p.grad
        if grad_ref is None:
            if grad is not None:
                return False
        elif grad is None or grad is not grad_ref() or (grad._local_tensor if as_dtensor else grad).data_ptr() != ptr:
            return False
    if flat.grad is None:
        flat.grad = flat_grad
    return True


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """``p.grad = g``, also where ``g`` is in low precision (keep_low_precision_grads): as torch's FSDP1,
    through ``.data``, which the ``.grad`` setter's dtype check does not see."""
    if g is None or g.dtype == p.dtype:
        p.grad = g
        return
    if p.grad is None or p.grad.shape != g.shape:
        p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand(g.shape)
    p.grad.data = g


def note_grads(s: UnitState, grads: tuple[torch.Tensor | None, ...]) -> None:
    """In post-backward: which parameters got a gradient (the others keep ``.grad = None``)."""
    seen = s.orig_grad_seen
    every = s.reduce_unused  # fully_shard's set_reduce_scatter_unused_params: each one, as if it got one
    for i, g in enumerate(grads):
        if every or g is not None:
            seen[i] = True


def writeback(s: UnitState) -> None:
    """What the user changed since the last iteration, into the flat shard and its gradient (see the note), before
    either is read. The checks run as they are, the copies (rare) under no_grad."""
    if not s.config.dim0_layout:  # (fully_shard's parameters stay on the shard: see [Note: DTensor parameters])
        _write_back_data(s)
    write_back_grads(s)


def write_back_before_forward(s: UnitState) -> None:
    """Before every iteration: the class's ``writeback`` (a zeroed flat gradient dropped there, as torch's FSDP1 does);
    fully_shard's gradients are written back when the backward starts, its zeroed ones freed already (see [Note: A
    gradient set to None is freed])."""
    if not s.config.dim0_layout:
        writeback(s)


def write_back_grads(s: UnitState) -> None:
    """The gradient half of ``writeback``, at the start of every backward (see [Note: A gradient set to None is
    freed]): gradients set to None clear the gradient shard, replaced ones are copied into it."""
    flat = s.flat_param
    if _grads_as_given(s, flat):
        return
    given, s.orig_grads_given = s.orig_grads_given, None
    grads = [p.grad for p in s.orig_params]
    s.orig_grad_held = [g is not None for g in grads]
    if all(g is None for g in grads):  # zero_grad(set_to_none=True)
        flat.grad = None
        return
    if flat.grad is None and given is not None:
        # The shard the kept ones are views of, written in place (one shard, not two), unless a ``.grad`` set to None
        # or replaced since still lives (the user holds it: torch's leaves it as it is)
        old = given[0]()
        if old is not None and all(r is None or r() is None or r() is g for (r, _), g in zip(given[1], grads)):
            flat.grad = old
    with torch.no_grad():
        _copy_grads_back(s, flat, grads)


def _copy_grads_back(s: UnitState, flat: nn.Parameter, grads: list[torch.Tensor | None]) -> None:
    flat_grad = flat.grad
    if flat_grad is None:
        flat_grad = torch.zeros_like(flat)
    for index, target in _grad_targets(s, flat_grad):
        g = grads[index]
        if g is None:
            target.zero_()
            continue
        local = _dtensor_params.local_of(g) if s.config.dim0_layout else g
        if local.data_ptr() != target.data_ptr():
            target.copy_(local.reshape(target.shape))
    if flat.grad is not flat_grad:
        flat.grad = flat_grad


def _write_back_data(s: UnitState) -> None:
    """A parameter whose data was replaced between iterations: the new values into the shard."""
    for p, view in zip(s.orig_params, sharded_views(s)):
        if p.data.data_ptr() != view.data_ptr() or p.data.shape != view.shape:
            if p.data.numel() != view.numel():
                raise RuntimeError(
                    f"FullyShardedDataParallel: parameter '{_name_of(s, p)}' was given data of "
                    f"{p.data.numel()} elements between iterations but holds {view.numel()} on this rank; "
                    f"with use_orig_params=True change a parameter's values in place (or inside "
                    f"FSDP.summon_full_params), not its size."
                )
            with torch.no_grad():
                view.copy_(p.data.reshape(view.shape))
            p.data = view


def _name_of(s: UnitState, p: nn.Parameter) -> str:
    for name, q in zip(s.param_names, s.orig_params):
        if q is p:
            return name
    return "?"
