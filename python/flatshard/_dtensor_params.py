"""fully_shard's parameters: DTensors sharded on dim 0, whose local tensors are views of the unit's shard.

[Note: DTensor parameters]
As torch's FSDP2, and as the class's use_orig_params does with plain views (see [Note: Original parameters]
in _orig_params.py, whose functions hand over to these for a unit with ``config.dim0_layout``):
- Each managed parameter is replaced, on every module that registers it, by an ``nn.Parameter`` holding a
  ``DTensor`` over the unit's mesh with ``Shard(0)`` (HSDP: ``(Replicate(), Shard(0))``), whose local tensor is this rank's ``torch.chunk`` rows of
  it: a view of the unit's local shard (see [Note: Dim-0 layout] in csrc/flatshard/layout.h), so that an
  optimizer step on it is a step on the shard and the next all-gather sends it. Its values equal torch FSDP2's
  local tensor on every rank (tests/test_layout.py).
- In forward and backward the module attribute is the unsharded parameter (an autograd view of the buffer
  the all-gather was copied out into), which shadows the registered DTensor; resharding removes the shadow.
- After backward each parameter's ``.grad`` is a DTensor of the same placement over the matching rows of the
  gradient shard; a parameter that took no part in this iteration's backward keeps ``.grad = None``.
- At the start of each backward what the user did to the gradients is written back (``write_back_grads``):
  gradients set to None (``zero_grad``) clear the gradient shard, replaced ones are copied into it; set to None
  they are freed at once (see [Note: A gradient set to None is freed] in _orig_params.py).
- ``module._apply`` (``to_empty``, ``.to``, ``.float()``, ...) replaces each parameter's data: ``rebind``
  copies the new values into the shard and points the parameter back at it (torchtitan's ``to_empty``, then
  its in-place initialization, then lands in the shard). A cast (``.to(torch.float64)``) casts the shard first
  (``FSDPModule._apply``), so that the new values land in a shard of the new dtype; a move to another device is
  refused by name. A shard replaced whole (``move_shards_to_host`` and back) takes the parameters with it
  (``use_sharded_views``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from weakref import ref

import torch
from torch import nn

from flatshard import _C
from flatshard._common import OWNER_ATTR

if TYPE_CHECKING:
    from flatshard._state import UnitState


def _rows(s: UnitState) -> list[tuple[int, int, list[int], int, list[int]]]:
    """(start, numel, local shape, shard dim, contiguous strides of the local shape) of each parameter's rows in this
    rank's shard, read from the layout once per unit (each read of a layout's list property copies the whole list). A
    parameter sharded on dim d > 0 holds its chunk along d (see [Note: Sharding on another dim] in
    csrc/flatshard/layout.h)."""
    if s.dim0_rows is None:
        layout = s.handle.layout
        offsets, shapes, dims, rank = layout.offsets, layout.shapes, layout.shard_dims, s.handle.rank
        s.dim0_rows = []
        for i, (shape, dim) in enumerate(zip(shapes, dims)):
            rows = layout.rows_of_rank(i, rank)
            local = [rows, *shape[1:]] if dim == 0 else [n // layout.shard_factor if k == dim else n
                                                         for k, n in enumerate(shape)]
            strides = list(torch.empty(local, device="meta").stride())
            s.dim0_rows.append((offsets[i], rows * layout.row_numel(i), local, dim, strides))
    return s.dim0_rows


def local_views(s: UnitState, flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's rows on this rank, shaped ``(rows, *shape[1:])`` (its chunk's shape when sharded on another
    dim), as views of ``flat`` (the local shard or its gradient, 1-D and contiguous; one ``as_strided`` a parameter,
    half the host time of a slice and a view: this runs for every unit after every backward)."""
    base = flat.storage_offset()
    return [flat.as_strided(shape, strides, base + start) for start, _numel, shape, _dim, strides in _rows(s)]


# [Note: A state dict's tensors have storages of their own]
# A DTensor is a wrapper without memory whose ``storage_offset()`` is its local tensor's, and so is every DTensor
# that an op on it makes (``detach()``, which ``state_dict()`` calls). torch 2.13's pickler and ``__deepcopy__`` tell
# such a wrapper from a tensor with memory by ``data_ptr() == 0``, which an offset above 0 breaks:
# ``torch.save(model.state_dict())`` and ``copy.deepcopy`` of it raised "invalid python storage" for every parameter
# but the first of a unit (found by a new user's trial, 2026-11-28), and the first one saved its whole unit's shard.
# torch's FSDP2 gives each parameter a padded shard of its own; ours are the parameter's rows of the unit's one shard
# (see [Note: DTensor parameters]), and stay so: a parameter whose memory were a storage of its own could be moved
# away from the shard by anything that swaps a storage's memory (``share_memory_()``, a tensor put on a
# torch.multiprocessing queue), and training would go on silently wrong. So a state-dict post-hook on each module
# that registers parameters of a unit (``own_storages``; so wherever ``state_dict()`` is called from, a plain parent
# included) rebuilds those values over an alias of the same memory with a storage of its own
# (``_C.alias_with_own_storage``, which keeps the shard's storage alive): offset 0, so that ``torch.save`` writes the
# parameter's own bytes and ``copy.deepcopy`` copies them, while the value still shares the parameter's memory, as
# torch's ``detach()`` does (an optimizer's step shows in it; DCP loads into it). What swaps a
# state dict value's memory takes that value away from the parameter, not the parameter away from the shard.
# ``keep_vars=True`` state dicts hold the parameters themselves, unchanged. Gradients are views of the gradient
# shard, as torch's FSDP2's are (``torch.save(p.grad)`` fails on both alike).
def own_storages(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """``module``'s parameters in ``state_dict`` (under ``prefix``), each a DTensor whose local tensor is a view into
    its unit's shard, rebuilt over an alias with a storage of its own (see the Note)."""
    for attr in module._parameters:
        value = state_dict.get(prefix + attr)
        if type(value) is _DTensor:  # (not a Parameter: keep_vars keeps them)
            state_dict[prefix + attr] = on_spec_of(value, _C.alias_with_own_storage(value._local_tensor))


def _spec(s: UnitState, index: int, local: torch.Tensor, shape: list[int]) -> Any:
    """The DTensorSpec of parameter ``index`` with ``local`` as this rank's part, a DTensor of ``shape``: ``Shard(d)``
    on its shard dim (0 unless shard_placement_fn said otherwise), and ``Replicate()`` over HSDP's first mesh dim. The
    parameter is built on ``local`` itself, wherever it is (``sharded_param``): ``DTensor.from_local`` would copy a
    host shard (CPUOffloadPolicy, move_shards_to_host) to the mesh's device, so that the parameter would no longer be
    the shard (seen on a GPU, 2026-11-28); torch's FSDP2 builds its host DTensors the same way."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    tp = s.tp_params.get(index)
    if tp is not None:  # (see [Note: Tensor-parallel parameters] in _tensor_parallel.py)
        mesh, placements = tp.mesh, tp.placements
    else:
        mesh = s.config.mesh
        dim = _rows(s)[index][3]
        placements = (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


# [Note: A parameter's wrapper at offset 0]
# torch 2.13's DTensor constructor gives the wrapper its local tensor's storage offset, and a DTensor over a view at an
# offset cannot be pickled: ``torch.save`` and ``copy.deepcopy`` tell a wrapper without memory from a tensor with
# memory by ``data_ptr() == 0``, which the offset breaks ("invalid python storage"; torch's own DTensors fail so too,
# ``torch.save(dtensor[4:])``). torch's FSDP2 parameters are at offset 0 (a padded shard each); ours are rows of the
# unit's one shard (see [Note: DTensor parameters]), so each parameter's wrapper is built over an alias of its rows at
# offset 0, with the same sizes, strides, dtype and device, and then given its rows as its local tensor: what its
# methods, ops and optimizers read. ``torch.save(p)`` and ``torch.save(dict(model.named_parameters()))`` then work as
# with torch's FSDP2 (a parameter saved alone writes its unit's shard: its storage). ``nn.Parameter(dtensor)`` would
# rebuild the wrapper through ``detach()``, at the offset again: the parameter is marked as ``nn.Parameter`` marks a
# tensor subclass (``_is_param``). torch 2.11 builds DTensors in Python, at offset 0 always. Values derived by ops
# (``p.detach()``, ``state_dict()``'s) are torch's wrappers at the offset: see [Note: A state dict's tensors have
# storages of their own].
def sharded_param(s: UnitState, index: int, local: torch.Tensor, shape: list[int], requires_grad: bool) -> nn.Parameter:
    """Parameter ``index`` as an ``nn.Parameter`` holding a DTensor over ``local`` (``_spec``), its wrapper at storage
    offset 0 (see the Note)."""
    spec = _spec(s, index, local, shape)
    with torch.no_grad():
        if _NEW_DTENSOR is None:  # (torch 2.11: at offset 0 already)
            return nn.Parameter(_DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)
        base = local if local.storage_offset() == 0 else local.as_strided(local.shape, local.stride(), 0)
        param = _NEW_DTENSOR(_DTensor, base, spec, requires_grad=requires_grad)
    param._local_tensor = local
    param._is_param = True
    return param


def init(s: UnitState, params: list[nn.Parameter]) -> None:
    """At ``fully_shard``: the modules' parameters become DTensor parameters over the shard."""
    global _DTensor
    from torch.distributed.tensor import DTensor

    _DTensor = DTensor
    layout = s.handle.layout
    # (the parameters that were DTensors over a TP mesh, by index from now on)
    s.tp_params = {i: s.tp_params[id(p)] for i, p in enumerate(params) if id(p) in s.tp_params}
    sharded = []
    for index, (p, local) in enumerate(zip(params, local_views(s, s.flat_param.detach()))):
        shape = list(s.tp_params[index].shape) if index in s.tp_params else list(p.shape)
        sharded.append(sharded_param(s, index, local, shape, p.requires_grad))
    for m, attr, index in s.param_slots:
        m._parameters[attr] = sharded[index]
    for p, fqn in zip(sharded, s.param_names):  # (an outer fully_shard must not take them again)
        setattr(p, OWNER_ATTR, (s.name, fqn))
    s.orig_params = sharded
    s.orig_grad_seen = [False] * len(sharded)
    s.orig_grad_held = [False] * len(sharded)
    assert layout.kind.name == "DIM0"


@torch.no_grad()
def use_sharded_views(s: UnitState) -> None:
    """The DTensor parameters hold views of the shard from ``init`` on; after the shard itself was replaced (moved
    to the host and back: ``move_shards_to_host``), each is swapped onto its rows of the new one, whole (its
    identity kept, so that an optimizer's references stay valid)."""
    for index, (p, view) in enumerate(zip(s.orig_params, local_views(s, s.flat_param.detach()))):
        local = p._local_tensor
        if local.data_ptr() != view.data_ptr() or local.device != view.device:
            torch.utils.swap_tensors(p, sharded_param(s, index, view, list(p.shape), p.requires_grad))


def use_grad_views(s: UnitState, flat_grad: torch.Tensor) -> tuple[torch.Tensor, list] | None:
    """``_orig_params.use_grad_views`` for a gradient shard of the parameters' dtype (the common case, once a unit
    after every backward): each parameter that got a gradient since the last reduced backward, or held one
    (``orig_grad_held``), gets a DTensor over its rows as its ``.grad`` (``on_spec_of``, inlined: this loop is most of
    what fully_shard's backward costs beyond the class's), the others None; returns what ``s.orig_grads_given``
    records (None when no gradient was given): weak references, see [Note: A gradient set to None is freed] in
    _orig_params.py."""
    base = flat_grad.storage_offset()
    view = flat_grad.as_strided
    seen, held = s.orig_grad_seen, s.orig_grad_held  # (``held`` updated in place: its list is the unit's own)
    given = []
    any_given = False
    for i, (p, row) in enumerate(zip(s.orig_params, _rows(s))):
        if (seen[i] or held[i]) and p.requires_grad:
            local = view(row[2], row[4], base + row[0])
            grad = _NEW_DTENSOR(_DTensor, local, p._spec, requires_grad=False) if _NEW_DTENSOR is not None \
                else on_spec_of(p, local)
            p.grad = grad
            given.append((ref(grad), local.data_ptr()))
            held[i] = any_given = True
        else:
            p.grad = None
            given.append((None, 0))
            held[i] = False
    return (ref(flat_grad), given) if any_given else None


def on_spec_of(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``local`` on ``p``'s own spec (mesh, placements, global shape, dtype): ``p``'s ``.grad`` over its
    rows of the gradient shard, or a state dict's value over its alias. Building a spec costs ~0.3 ms, this one serves
    every backward (as torch's FSDP2 does: DTensor's constructor, not from_local). Where torch has it, straight
    through the constructor's C++
    ``__new__`` (1.7 µs here, against 7.6 µs through ``DTensor(...)``, whose ``__init__`` only passes through its
    tracing decorators)."""
    from torch.distributed.tensor import DTensor

    if _NEW_DTENSOR is not None:
        return _NEW_DTENSOR(DTensor, local, p._spec, requires_grad=False)
    return DTensor(local, p._spec, requires_grad=False)


_NEW_DTENSOR = getattr(torch.Tensor, "_dtensor__new__", None)  # (torch 2.13; 2.11 builds DTensors in Python)
_DTensor: type | None = None  # torch's DTensor, set by ``init`` (importing it with flatshard costs its users' start-up)


def local_of(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's local tensor (``to_local()`` is an autograd function: microseconds a parameter a
    step)."""
    return grad._local_tensor


@torch.no_grad()
def rebind(s: UnitState) -> None:
    """After ``_apply`` replaced parameters' data, or the parameters themselves were replaced on their modules
    (``load_state_dict(assign=True)``, transformers' weight loading ``setattr``s new DTensor parameters; found at
    lazy init too, as torch's FSDP2 does): the values into the shard, the parameters back onto it. A replacing
    parameter is adopted, as torch's FSDP2 adopts it: that object becomes the unit's parameter (its tensor now the
    shard's rows), so an optimizer built on the module's parameters after the replacement steps the shard."""
    views = local_views(s, s.flat_param.detach())
    for m, attr, index in s.param_slots:
        current, ours = m._parameters.get(attr), s.orig_params[index]
        if current is None or current is ours or not isinstance(current, nn.Parameter):  # (a plain view: unsharded)
            continue
        _copy_into(s.param_names[index], _local_of_param(current), views[index])
        torch.utils.swap_tensors(current, ours)  # `current` is now the shard's parameter, ``ours`` the old values
        s.orig_params[index] = current
        for other, other_attr, other_index in s.param_slots:  # (a tied parameter's other registrations)
            if other_index == index:
                other._parameters[other_attr] = current
    for index, (name, p, view) in enumerate(zip(s.param_names, s.orig_params, views)):
        local = p.to_local()
        if local.data_ptr() == view.data_ptr() and local.shape == view.shape:
            continue
        _copy_into(name, local, view)
        # (A DTensor's local tensor is not what ``.data =`` sets: swapped whole, as nn.Module._apply does.)
        torch.utils.swap_tensors(p, sharded_param(s, index, view, list(p.shape), p.requires_grad))


def _local_of_param(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _copy_into(name: str, local: torch.Tensor, view: torch.Tensor) -> None:
    """A parameter's new values (this rank's rows) into its rows of the shard; a move or cast is refused."""
    if local.device != view.device or local.dtype != view.dtype or local.shape != view.shape:
        raise NotImplementedError(
            f"fully_shard: parameter '{name}' was replaced by {local.dtype} rows of shape {tuple(local.shape)} on "
            f"{local.device} after fully_shard (its rows here are {view.dtype} {tuple(view.shape)} on {view.device}); "
            f"flatshard's fully_shard does not support moving or casting it yet: move or cast the module before "
            f"fully_shard (to_empty on the same device is fine), and load DTensor state dicts.")
    view.copy_(local)


# [Note: Post-accumulate-grad hooks]
# ``p.register_post_accumulate_grad_hook(hook)`` on a fully_shard parameter: torch's FSDP2 calls ``hook(p)`` once its
# reduced gradient is ``p.grad``, in the unit's post-backward, unit after unit as the backward goes on; the
# "optimizer in backward" pattern (torchtune's ``optimizer_in_bwd``) steps and zeroes each parameter there, so that
# one unit's gradients live at a time. autograd never calls them itself: the sharded parameters take no part in the
# graph (their unsharded views do). So a unit's post-backward that reduces, where one of its parameters has such a
# hook, completes the reductions issued so far (its own included: the hook reads the gradient; the overlap of this
# unit's reduction with the next unit's backward is what it costs) and hands out its gradients then
# (``_orig_params.hand_out_grads``), not at the end of the backward. It issues nothing: a small unit's reduction that
# waits to go together with the next units' (see [Note: Small units reduced together] in csrc/flatshard/scheduler.h)
# stays waiting, its hooks called at the end of the backward, so that a hook on one rank only (logging) never groups
# that rank's exchanges otherwise than its peers'. A unit reduced again in the same backward (reentrant checkpointing's
# inner backwards) adds into what the hooks left (``write_back_grads`` first) and calls them again. A unit reduced
# only at the end of the backward (a use whose post-backward never ran) calls them there, after every unit's
# gradients are given. As torch's: called for each parameter that got a gradient since the last reduced backward (a
# no_sync micro-batch's included; every one with set_reduce_scatter_unused_params), in the order of torch's parameter
# group; not in a backward without gradient sync, nor where set_requires_all_reduce(False) leaves the gradient
# unreduced over the replicas (no ``.grad`` is given there). One order differs: a unit whose forward inputs need no
# gradient (the first unit over a batch, a root over token ids) has its post-backward, hence its hooks, at the end of
# torch's backward, where flatshard's runs once its parameters' gradients are in (earlier; the values are the same).
# The class does not call them (torch's FSDP1 neither).


def has_post_accumulate_grad_hooks(s: UnitState) -> bool:
    return any(p._post_accumulate_grad_hooks for p in s.orig_params)


def hooked_params(s: UnitState, got: list[bool]) -> list[torch.Tensor]:
    """The parameters of ``s`` whose post-accumulate-grad hooks run for the gradients just handed out: those that got
    one since the last reduced backward (``got``), in torch's order (its parameter group's)."""
    hooked = []
    for index in s.fsdp2_param_order:
        p = s.orig_params[index]
        if p._post_accumulate_grad_hooks and got[index] and p.grad is not None:
            hooked.append(p)
    return hooked


def run_post_accumulate_grad_hooks(params: list[torch.Tensor]) -> None:
    for p in params:
        for hook in tuple(p._post_accumulate_grad_hooks.values()):
            hook(p)
