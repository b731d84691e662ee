"""Building a unit from its configuration: device, meta-device materialization, sync, the flat parameter.

Everything here runs at wrap time (``FullyShardedDataParallel.__init__``); nothing
here is on the per-step path (the root's lazy init is in _runtime.py, beside the
lifecycle it starts).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, AbstractSet, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _C, _mixed_precision, _orig_params, _stale_optimizer
from flatshard._common import FLAT_PARAM, OWNER_ATTR, is_unit, join
from flatshard._stale_optimizer import REPLACED_ATTR
from flatshard._profiling import collective_range

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel
    from flatshard._state import UnitState


def unit_device(device_id: torch.device | None, module: nn.Module) -> torch.device:
    """Where a unit computes and keeps its storage: ``device_id``, else where its module's tensors are (the
    first not on the meta device), else the current CUDA device or the CPU (see [Note: Unit configuration])."""
    if device_id is not None:
        return device_id
    real = [t.device for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta"]
    if real:
        return real[0]
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def parent_slots(root: nn.Module) -> dict[nn.Module, tuple[nn.Module, str]]:
    slots: dict[nn.Module, tuple[nn.Module, str]] = {}
    for parent in root.modules():
        for attr, child in parent.named_children():
            slots.setdefault(child, (parent, attr))
    return slots


def unit_modules(module: nn.Module, ignored: set[nn.Module],
                 is_inner_unit: Callable[[nn.Module], bool] = is_unit) -> Iterator[tuple[str, nn.Module]]:
    """(relative name, module) for the modules a unit owns: its subtree minus inner units and ignored ones
    (nothing when the wrapped module is itself a unit: ``FSDP(FSDP(m))``). ``is_inner_unit``: what counts as
    a unit (flatshard.plan passes the modules it plans to wrap)."""
    if module in ignored or is_inner_unit(module):
        return
    stack = [("", module)]
    seen: set[int] = set()
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield prefix, m
        children = [
            (join(prefix, name), c)
            for name, c in m.named_children()
            if not is_inner_unit(c) and c not in ignored
        ]
        stack.extend(reversed(children))


def all_gather_limit(limit_all_gathers: bool) -> int:
    """In-flight all-gathers allowed: FLATSHARD_ALL_GATHER_LIMIT (default 2), or 0 (unbounded)."""
    if not limit_all_gathers:
        return 0
    raw = os.environ.get("FLATSHARD_ALL_GATHER_LIMIT", "2")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(
            f"FLATSHARD_ALL_GATHER_LIMIT: expected an integer >= 1 but got {raw!r}. Unset it (default 2) "
            f"or pass limit_all_gathers=False for no limit."
        )
    return limit


def build_flat_param(unit: FullyShardedDataParallel, module: nn.Module, more_modules: list[nn.Module] = ()) -> None:
    """Collects the unit's parameters, materializes and moves them, flattens and shards, registers.

    Sets the unit state's ``param_slots``, ``param_names``, ``param_local_names``,
    ``handle`` (None for a unit without parameters of its own) and ``flat_param``
    (the local shard, registered as the unit's ``_flat_param`` unless use_orig_params).
    ``more_modules``: the rest of fully_shard's list (see [Note: A list of modules] in _fully_shard.py), whose
    modules' names are prefixed by their index in the list.
    """
    s = unit._unit_state
    unit_mods = list(unit_modules(module, s.config.ignored_modules))
    members = [unit_mods]
    for index, more in enumerate(more_modules, start=1):
        members.append([(join(str(index), prefix), m) for prefix, m in unit_modules(more, s.config.ignored_modules)
                        if all(m is not seen for _, seen in unit_mods)])
        unit_mods += members[-1]
    _mark_managed(unit_mods)
    meta_originals = _materialize(s, unit_mods)
    params, names, local_names, slots = _collect_params(s, unit_mods, s.config.ignored_params)
    s.param_slots = slots
    if s.config.dim0_layout:
        s.fsdp2_param_order = _fsdp2_param_order(members, slots)
    s.param_names = names
    s.param_local_names = local_names
    s.handle = None
    _place_and_sync(s, unit_mods, params, names)
    if not params:
        return
    for p, fqn in zip(params, names):
        setattr(p, OWNER_ATTR, (s.name, fqn))
        if id(p) in meta_originals:  # other units may still hold the meta original
            setattr(meta_originals[id(p)], OWNER_ATTR, (s.name, fqn))
    layout = _build_handle(s, params, local_names)
    _register(unit, s, params, layout)


def _fsdp2_param_order(members: list[list[tuple[str, nn.Module]]],
                       slots: list[tuple[nn.Module, str, int]]) -> list[int]:
    """The order of torch's FSDP2 parameter group for these parameters (indices into the flat order, which puts the
    trainable first): each member module's subtree in post-order (children first), each module's own parameters as
    registered, a shared one at its first place. What users see of it: the order of the post-accumulate-grad hooks."""
    index_of = {(id(m), attr): index for m, attr, index in slots}
    order: list[int] = []
    placed: set[int] = set()
    for mods in members:  # (pre-order, with names: post-order by a stack of the modules not yet left)
        post: list[nn.Module] = []
        stack: list[tuple[str, nn.Module]] = []
        for name, m in mods:
            while stack and stack[-1][0] and not name.startswith(stack[-1][0] + "."):
                post.append(stack.pop()[1])
            stack.append((name, m))
        post += [m for _, m in reversed(stack)]
        for m in post:
            for attr in m._parameters:
                index = index_of.get((id(m), attr))
                if index is not None and index not in placed:
                    placed.add(index)
                    order.append(index)
    return order


def _mark_managed(unit_mods: list[tuple[str, nn.Module]]) -> None:
    """torch's marks, read by transformers' generate() and torch.compile (see [Note: torch's internals])."""
    for _, m in unit_mods:
        m._is_fsdp_managed_module = True
        # dynamo reads this flag only as a gate (variables/builder.py: "Dynamo only supports FSDP with
        # use_orig_params=True"): what it needs is that a managed module's attributes are tensors of the original
        # parameters' shapes, not a FlatParameter. flatshard gives them that in both modes (views of the unsharded
        # buffer at every forward), as torch's fully_shard does, which sets the flag for the same reason.
        m._fsdp_use_orig_params = True


def _register(unit: FullyShardedDataParallel, s: UnitState, params: list[nn.Parameter],
              layout: _C.FlatParamLayout) -> None:
    """What the module shows after wrapping: the original parameters as views of the shard (use_orig_params), or
    the flat shard as ``_flat_param`` and the original attributes as plain tensors."""
    if s.config.use_orig_params:  # see [Note: Original parameters] in _orig_params.py
        unit.__dict__[FLAT_PARAM] = s.flat_param
        s.frozen_indices = ([i for i, p in enumerate(params) if not p.requires_grad] if s.flat_param.requires_grad
                            else [])
        # Reduce the trainable prefix only (see [Note: Trainable prefix] in flat_param.h): the flat layout's first
        # elements, or in the dim-0 layout the trainable parameters' rows at the start of each rank's shard.
        if s.frozen_indices and not s.handle.is_replicated:
            trainable = len(params) - len(s.frozen_indices)
            s.handle.set_reduce_prefix(
                sum(layout.rows_per_shard(i) * layout.row_numel(i) for i in range(trainable)) if s.config.dim0_layout
                else layout.offsets[trainable - 1] + layout.numels[trainable - 1])
        _orig_params.init(s, params)
        return
    unit.register_parameter(FLAT_PARAM, s.flat_param)
    # The module attributes become plain tensors: views of the unsharded
    # buffer (storage-less while sharded, see [Note: Unsharded storage]).
    for m, attr, _ in s.param_slots:
        del m._parameters[attr]
    for p, fqn in zip(params, s.param_names):  # see [Note: An optimizer built before wrapping]
        setattr(p, REPLACED_ATTR, (s.name, fqn))
    _stale_optimizer.install()


def _materialize(s: UnitState, unit_mods: list[tuple[str, nn.Module]]) -> dict[int, torch.Tensor]:
    """The unit's tensors off the meta device (``param_init_fn``, or ``reset_parameters()``) and its buffers on
    its device; {id of a new parameter: the meta original it replaced}."""
    if s.config.param_init_fn is not None and has_meta(unit_mods):
        meta_originals = materialize_with(s.config.param_init_fn, unit_mods, s.name)
        if s.config.device_id is None:  # as torch: the device param_init_fn chose
            real = [t for _, m in unit_mods for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
            if real:
                s.device = real[0].device
    elif s.config.meta_to_empty:  # the parameters stay on meta: the handle allocates the shard alone (see
        meta_originals = {}      # [Note: A shard from meta parameters] in csrc/flatshard/flat_param.h)
    else:
        meta_originals = materialize_meta(unit_mods, s.device, s.name)
    for _, m in unit_mods:  # buffers go where the parameters go (torch moves the whole module)
        for attr, b in m._buffers.items():
            if b is not None and b.device != s.device:
                m._buffers[attr] = torch.empty_like(b, device=s.device) if b.is_meta else b.to(s.device)
    return meta_originals


def _collect_params(s: UnitState, unit_mods: list[tuple[str, nn.Module]], ignored_params: AbstractSet[nn.Parameter],
                    ) -> tuple[list[nn.Parameter], list[str], list[str], list[tuple[nn.Module, str, int]]]:
    """The unit's parameters in flat order (a tied one once; with use_orig_params, trainable ones first), their
    full and local names, and every registration of each as (module, attribute, index into the flat order)."""
    params: list[nn.Parameter] = []
    names: list[str] = []
    local_names: list[str] = []  # relative to this unit's module (its own name may change at lazy init)
    slots: list[tuple[nn.Module, str, int]] = []
    index_of: dict[int, int] = {}
    for prefix, m in unit_mods:
        for attr, p in m._parameters.items():
            if p is None or p in ignored_params:
                continue
            fqn = join(s.name, join(prefix, attr))
            check_not_owned(p, fqn, s.config.dim0_layout)
            if id(p) not in index_of:
                index_of[id(p)] = len(params)
                params.append(p)
                names.append(fqn)
                local_names.append(join(prefix, attr))
            slots.append((m, attr, index_of[id(p)]))
    if s.config.use_orig_params and len({p.requires_grad for p in params}) > 1:
        # Trainable parameters first, frozen ones after: see [Note: Trainable prefix] in flat_param.h.
        order = sorted(range(len(params)), key=lambda i: not params[i].requires_grad)
        new_index = {old: new for new, old in enumerate(order)}
        params, names, local_names = ([seq[i] for i in order] for seq in (params, names, local_names))
        slots = [(m, attr, new_index[i]) for m, attr, i in slots]
    return params, names, local_names, slots


def _place_and_sync(s: UnitState, unit_mods: list[tuple[str, nn.Module]], params: list[nn.Parameter],
                    names: list[str]) -> None:
    """Checks the parameters can share one flat parameter, moves them to the unit's device and, with
    ``sync_module_states``, broadcasts them and the buffers from the first rank of each group."""
    if params:
        check_uniform(params, names, s.name, mixed_requires_grad=s.config.use_orig_params)
    if params and params[0].device != s.device and not params[0].is_meta:
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(s.device)
    if s.config.sync_module_states:
        buffers = list({id(b): b for _, m in unit_mods for b in m._buffers.values() if b is not None}.values())
        for group in (s.config.process_group, s.config.replicate_group):
            if group is not None:
                broadcast_from_first_rank([p.detach() for p in params] + buffers, group)


def _build_handle(s: UnitState, params: list[nn.Parameter], local_names: list[str]) -> _C.FlatParamLayout:
    """The C++ handle (flattened and sharded) and the local shard as an nn.Parameter with torch's marks; the
    layout."""
    shapes = [list(p.shape) for p in params]
    if s.config.dim0_layout:
        # (a tensor-parallel parameter's dim was chosen at fully_shard: see [Note: Tensor-parallel parameters])
        dims = [s.tp_params[id(p)].dim if id(p) in s.tp_params else 0 for p in params]
        plain = [i for i, p in enumerate(params) if id(p) not in s.tp_params]
        if s.config.shard_dims_of and plain:
            given = s.config.shard_dims_of([params[i] for i in plain], [local_names[i] for i in plain],
                                           s.config.shard_factor)
            for i, dim in zip(plain, given):
                dims[i] = dim
        layout = _C.FlatParamLayout.dim0(shapes, s.config.shard_factor, dims)
    else:
        layout = _C.FlatParamLayout(shapes, s.config.shard_factor)
    dtypes = _mixed_precision.flat_param_dtypes(
        s.config.mixed_precision, params[0].dtype, s.config.shard_factor == 1, s.config.offload_params, s.name,
    )
    with torch.no_grad():
        shard_rank = s.config.rank if s.config.shard_factor > 1 else 0
        s.handle = _C.FlatParamHandle(
            s.name, layout, shard_rank, [p.detach() for p in params],
            compute_device=s.device, offload=s.config.offload_params, pin_host_memory=s.config.pin_host_memory,
            **dtypes,
            predivide=s.config.predivide, postdivide=s.config.postdivide, all_reduce_replicas=s.config.replicate_group is not None,
        )
    s.storage_changed()
    flat = nn.Parameter(s.handle.local_shard, requires_grad=any(p.requires_grad for p in params))
    s.handle.set_local_shard(flat)
    s.flat_param = flat
    # torch's marks (see [Note: The handle] in _torch_facade/attributes.py): flattened, and the names in it.
    flat._fsdp_flattened = True
    flat._fqns = list(local_names)
    for p in params:
        p._fsdp_flattened = True
    return layout


def materialize_meta(
    unit_modules: list[tuple[str, nn.Module]], device: torch.device, unit_name: str
) -> dict[int, nn.Parameter]:
    """Materializes the unit's meta-device modules on ``device`` with their reset_parameters().

    Tied parameters stay tied (one new parameter per old one). A meta parameter
    another unit already owns is left alone, for the caller's tied-parameter
    check to report. Returns {id(new parameter): old meta parameter}.
    """
    # Every check before any change, so that an error leaves the model as it was.
    todo = []
    for prefix, m in unit_modules:
        states = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if not any(t.is_meta for t in states):
            continue
        if not callable(getattr(m, "reset_parameters", None)):
            name = join(unit_name, prefix) or type(m).__name__
            raise ValueError(
                f"FullyShardedDataParallel: module '{name}' ({type(m).__name__}) has tensors on the meta "
                f"device and no reset_parameters() to materialize them. Give it a reset_parameters() "
                f"method or build the model on a real device."
            )
        todo.append(m)
    new_of: dict[int, nn.Parameter] = {}
    old_of: dict[int, nn.Parameter] = {}
    for m in todo:
        for attr, p in m._parameters.items():
            if p is None or not p.is_meta or hasattr(p, OWNER_ATTR):
                continue
            if id(p) not in new_of:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new_of[id(p)] = new
                old_of[id(new)] = p
            m._parameters[attr] = new_of[id(p)]
        for attr, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[attr] = torch.empty_like(b, device=device)
    with torch.no_grad():
        for m in todo:
            m.reset_parameters()
    return old_of


def materialize_with(
    param_init_fn: Callable[[nn.Module], None], unit_modules: list[tuple[str, nn.Module]], unit_name: str
) -> dict[int, nn.Parameter]:
    """Calls ``param_init_fn`` on every module of the unit, as torch's FSDP does; checks nothing is left on meta.

    Parameters tied before are tied after only if ``param_init_fn`` keeps them
    so (``to_empty`` does not: re-tie them in ``param_init_fn``, as with torch).
    A meta parameter that another unit already owns (a tie split across units)
    is an error before anything runs. Returns {id(new parameter): the meta
    parameter it replaced}, so that the caller marks the meta one as owned.
    """
    slots = []
    for prefix, m in unit_modules:
        for attr, p in m._parameters.items():
            if p is not None and p.is_meta:
                check_not_owned(p, join(unit_name, join(prefix, attr)))
                slots.append((m, attr, p))
    # Breadth-first, root first, as torch calls it (a re-tie in param_init_fn may rely on that).
    for _, m in sorted(unit_modules, key=lambda pm: pm[0].count(".") + 1 if pm[0] else 0):
        param_init_fn(m)
    for prefix, m in unit_modules:
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and t.is_meta:
                name = join(unit_name, join(prefix, attr))
                raise ValueError(
                    f"FullyShardedDataParallel: '{name}' is still on the meta device after param_init_fn "
                    f"ran on module '{join(unit_name, prefix) or type(m).__name__}'. param_init_fn must "
                    f"materialize the module's own parameters and buffers, e.g. "
                    f"module.to_empty(device=..., recurse=False) followed by their initialization."
                )
    originals: dict[int, nn.Parameter] = {}
    for m, attr, old in slots:
        new = m._parameters.get(attr)
        if new is not None and new is not old:
            originals.setdefault(id(new), old)
    return originals


def has_meta(unit_modules: list[tuple[str, nn.Module]]) -> bool:
    return any(
        t.is_meta for _, m in unit_modules for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    )


def check_not_owned(p: torch.Tensor, fqn: str, fully_shard: bool = False) -> None:
    """Raises if another unit already owns ``p``: tied parameters must live in one unit (``fully_shard``: the
    front-end asking, whose phrase is torch FSDP2's; raised at the second ``fully_shard`` call, where torch's
    raises at the first forward)."""
    owner = getattr(p, OWNER_ATTR, None)
    is_dtensor = type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"
    if owner is None and is_dtensor:
        raise NotImplementedError(f"flatshard: parameter '{fqn}' is a DTensor (tensor parallelism?), which "
                                  f"flatshard's FullyShardedDataParallel does not shard; shard plain parameters, or "
                                  f"shard a tensor-parallel model with flatshard.fully_shard (FSDP2's API).")
    if owner is None:
        return
    owner_unit, owner_fqn = owner
    if fully_shard and not is_dtensor:  # a tie: the same parameter another unit took (torch's type and phrase)
        raise ValueError(
            f"fully_shard: Parameter '{fqn}' is shared with a parameter already managed by another FSDP group "
            f"('{owner_fqn}', sharded by an earlier fully_shard call). For shared/tied parameters, use "
            f"fully_shard([module_a, module_b]) to place them in the same FSDP group.")
    if is_dtensor:  # fully_shard's own
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is already sharded (as '{owner_fqn}' of the unit made by an earlier "
            f"fully_shard call): call fully_shard bottom-up, submodules first, once per parameter (a module two "
            f"units share goes into their common parent's unit).")
    raise ValueError(
        f"FullyShardedDataParallel: parameter '{fqn}' is the same tensor as "
        f"'{owner_fqn}', which unit '{owner_unit or '<root>'}' already owns: tied "
        f"parameters must live in one unit. Put modules '{fqn.rpartition('.')[0] or '<root>'}' "
        f"and '{owner_fqn.rpartition('.')[0] or '<root>'}' into one unit, e.g. do not "
        f"wrap either on its own, so that their common parent owns the parameter."
    )


def check_uniform(params: list[nn.Parameter], names: list[str], unit_name: str, mixed_requires_grad: bool) -> None:
    """One dtype and device per unit; one requires_grad too unless ``mixed_requires_grad`` (use_orig_params)."""
    unit = f"'{unit_name}'" if unit_name else "<root>"
    first = params[0]
    checks = [
        ("dtype", "Cast the module to one dtype (e.g. module.float()) or wrap those modules in separate units"),
        ("device", "Move the module to one device (or pass device_id=) or wrap those modules in separate units"),
    ]
    if not mixed_requires_grad:
        checks.append(("requires_grad", "Pass use_orig_params=True (frozen and trainable parameters may then share "
                                        "a unit), freeze or unfreeze whole units, or wrap the frozen modules in "
                                        "separate units"))
    for attr, fix in checks:
        for p, n in zip(params, names):
            if getattr(p, attr) != getattr(first, attr):
                raise ValueError(
                    f"FullyShardedDataParallel: unit {unit}: parameters of one unit must share one "
                    f"{attr}, but '{names[0]}' has {attr}={getattr(first, attr)} and '{n}' has "
                    f"{attr}={getattr(p, attr)}. {fix}."
                )


_SYNC_BUCKET_BYTES = 250 * 1024 * 1024  # as torch's FSDP1


def broadcast_from_first_rank(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """sync_module_states: every rank of ``group`` gets its first rank's values.

    Same-dtype tensors go in buckets of up to 250 MB (one broadcast each, so a
    large unit never needs twice its size); a larger tensor goes alone, in place.
    """
    if dist.get_world_size(group) == 1 or not tensors:
        return
    src = dist.get_global_rank(group, 0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for same in by_dtype.values():  # the same order on every rank: the module's
        size = _SYNC_BUCKET_BYTES
        for t in same:
            nbytes = t.numel() * t.element_size()
            if size + nbytes > _SYNC_BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += nbytes
    with torch.no_grad():
        for bucket in buckets:
            if len(bucket) == 1 and bucket[0].is_contiguous():
                with collective_range("sync_module_states broadcast"):
                    dist.broadcast(bucket[0], src=src, group=group)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            with collective_range("sync_module_states broadcast"):
                dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
