"""``FullyShardedDataParallel``: torch's FSDP interface over the flatshard runtime.

Each instance is one *unit*: it owns every parameter of its subtree that no
inner unit owns, flattened into one ``FlatParam`` (C++) whose local shard is the
``nn.Parameter`` registered here as ``_flat_param``. The root (outermost unit)
creates one ``Scheduler`` (C++) shared by all units below it.

[Note: Unit lifecycle]
forward (per call of a unit):
  unshard -> wait (+ forward prefetch: the unit that came next in the previous
  iteration's pre-forward order) -> hand the original parameters out
  as views of the unsharded buffer -> run the module -> reshard if the
  strategy reshards after forward (FULL_SHARD, HYBRID_SHARD; never the root
  while grad is enabled, its backward starts right away; always when grad is
  disabled) -> hook the outputs' gradients
backward, per use of a unit, in reverse:
  pre-backward (first gradient w.r.t. the use's outputs): unshard + wait
  (+ BACKWARD_PRE: then all-gather the unit that ran before it in this
  iteration's post-forward order, i.e. the next one in backward; it is still
  issued before this unit's reduce-scatter)
  post-backward (backward of ``_UnshardedViews``, once every view's gradient
  is complete): accumulate the gradients into the unit's flat gradient (see
  [Note: Gradient accumulation] in csrc/flatshard/flat_param.h); when no
  other use of the unit is pending and gradients are synchronized: reduce,
  (+ BACKWARD_POST: all-gather the next unit), reshard
end of backward (root's queued callback): reduce what is left, wait for every
  reduction, write the gradient shards to ``_flat_param.grad``, reshard
  everything (unless inside ``no_sync()``).
Between iterations only local shards (parameters and gradients) are alive.

[Note: Recomputation]
Activation checkpointing reruns module code during backward. Inside a unit
(checkpointed blocks, then FSDP): the rerun reads the module attributes, so
pre-backward hands out fresh autograd views of the re-gathered buffer
through a speculative use; if its backward runs (reentrant checkpointing
backpropagates through the rerun) it is a post-backward like any other, but
it never holds a reduction back. Around a unit (``checkpoint(unit, x)``): the
unit's own forward runs during backward; it is a recomputation: views as
above, no new pending use, no hooks, no reshard (the graph being
backpropagated needs the parameters).

[Note: Pending uses]
A unit reduces (and reshards) in a post-backward only when no other use of
its parameters is still to run its post-backward in this backward; backward
prefetch likewise skips units with nothing left to run. Both decide
collectives, so the answer must be the same on every rank: it comes from the
graph being executed (torch._C._will_engine_execute_node of each unrun use's
node), never from when Python frees objects (a rank that keeps an extra
forward's output, or collects garbage at another moment, must not change
which collectives it issues). Inside a nested backward (reentrant
checkpointing), where only the inner graph can be asked, every live unrun
use counts as pending.

[Note: no_sync]
Inside ``no_sync()`` no collective runs in backward: units stay unsharded
from their first forward on (so backward needs no all-gather) and their
gradients accumulate unsharded (no reduction). The first backward outside
the context reduces everything once and reshards. This costs the memory of
unsharded parameters and gradients during accumulation (as DDP), which is
what buys zero communication; torch's FSDP1 re-gathers FULL_SHARD parameters
in backward instead.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import os
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _C
from flatshard.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from flatshard.wrap import _plan_wraps

__all__ = ["FullyShardedDataParallel"]

logger = logging.getLogger("flatshard")

_WRAPPED = "_fsdp_wrapped_module"
_FLAT_PARAM = "_flat_param"
_WRAPPED_PREFIX = _WRAPPED + "."
# Set on an original parameter once a unit owns it: (unit name, parameter name).
_OWNER_ATTR = "_flatshard_owner"

# Torch's FSDP constructor arguments flatshard does not implement yet, with the
# value that means "not used". A non-default value raises NotImplementedError.
_NOT_YET = {
    "cpu_offload": (None, CPUOffload(offload_params=False)),
    "mixed_precision": (None, MixedPrecision()),
    "use_orig_params": (False,),
    "ignored_states": (None,),
}
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
_SHARDED = _C.ShardedState.SHARDED


def _clean_name(name: str) -> str:
    return name.replace(_WRAPPED_PREFIX, "")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Use:
    """One use of a unit's parameters by autograd.

    Made by a grad-enabled forward call (its place in the post-forward order
    is recorded for backward prefetch), or speculatively when views are handed
    out again during backward (see [Note: Recomputation]). ``node`` is a weak
    reference to its ``_UnshardedViews`` node. See [Note: Pending uses].
    """

    __slots__ = ("node", "order", "index", "done", "speculative", "__weakref__")

    def __init__(self, unit: "FullyShardedDataParallel", speculative: bool = False) -> None:
        self.node: Callable[[], Any] | None = None
        self.order: list[FullyShardedDataParallel] = []
        self.index = -1
        self.done = False
        self.speculative = speculative
        unit._uses.add(self)

    def finish(self) -> None:
        """Its post-backward ran, or the backward it belonged to is over. Safe to call twice."""
        self.done = True


class _UnshardedViews(torch.autograd.Function):
    """Hands a unit's original parameters to autograd as views of its unsharded buffer.

    Forward: the views. Backward runs once every view's gradient is complete,
    which is exactly the unit's post-backward point for this use (see
    [Note: Unit lifecycle]). The gradient shard reaches ``_flat_param.grad``
    at the end of backward, so no gradient is returned here.
    """

    @staticmethod
    def forward(ctx, unit: "FullyShardedDataParallel", use: _Use, flat_param: nn.Parameter):
        ctx.unit = unit
        ctx.use = use
        use.node = weakref.ref(ctx)  # ctx is the node: it dies with the graph
        return tuple(unit._handle.views())

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit._post_backward(ctx.use, grads)
        return None, None, None


class FullyShardedDataParallel(nn.Module):
    """Shards a module's parameters across ranks; a drop-in for torch's FSDP (FSDP1).

    The constructor takes torch's arguments. Implemented: ``module``,
    ``process_group`` (a group, or a (shard, replicate) tuple for hybrid),
    ``sharding_strategy`` (all five), ``auto_wrap_policy`` (ours or torch's),
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``,
    ``ignored_modules``, ``param_init_fn``, ``device_id``,
    ``sync_module_states`` and ``device_mesh``. Any other argument with a
    non-default value raises ``NotImplementedError`` naming it.

    A unit with tensors on the meta device is materialized when it is wrapped,
    one unit at a time: by ``param_init_fn``, called on each of the unit's
    modules (as torch does), or else by the modules' ``reset_parameters()``.
    ``sync_module_states=True`` then broadcasts the unit's parameters and
    buffers from the first rank of its group (and, for hybrid sharding, of
    its replicate group) before sharding.

    After wrapping, ``parameters()`` yields the local shards (one flat
    parameter per unit) for the optimizer, as torch's FSDP does with
    ``use_orig_params=False``.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Any | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: Any | None = None,
        *,
        _unit_name: str = "",
    ):
        super().__init__()
        given = dict(
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
        )
        for arg, defaults in _NOT_YET.items():
            if not any(given[arg] is d or given[arg] == d for d in defaults):
                raise NotImplementedError(
                    f"FullyShardedDataParallel: {arg}={given[arg]!r} is not implemented in flatshard "
                    f"yet. Remove the argument (default {defaults[0]!r}) or use "
                    f"torch.distributed.fsdp for this model."
                )
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        if not isinstance(strategy, ShardingStrategy):
            raise ValueError(
                f"FullyShardedDataParallel: sharding_strategy: expected a ShardingStrategy but got "
                f"{sharding_strategy!r}"
            )
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(
                f"FullyShardedDataParallel: param_init_fn: expected a callable taking a module but got "
                f"{param_init_fn!r}"
            )
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise ValueError(
                f"FullyShardedDataParallel: backward_prefetch: expected a BackwardPrefetch or None "
                f"but got {backward_prefetch!r}"
            )
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                f"FullyShardedDataParallel: module '{_unit_name or type(module.module).__name__}' is "
                f"already wrapped; wrap each module once."
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedDataParallel: expected an initialized default process group but "
                "torch.distributed is not initialized. Call torch.distributed.init_process_group() "
                "first (torchrun sets the environment it needs), or pass process_group=."
            )
        shard_group, replicate_group = _resolve_groups(process_group, device_mesh, strategy)
        self._process_group = shard_group
        self._replicate_group = replicate_group
        self._rank = dist.get_rank(shard_group)
        self._world_size = dist.get_world_size(shard_group)
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        # Gradients are averaged over every data-parallel rank (SUM, then divide).
        self._divide_factor = float(self._world_size * replicas)
        self._shard_factor = 1 if strategy == ShardingStrategy.NO_SHARD else self._world_size
        self._sharding_strategy = strategy
        self._reshard_after_forward = strategy in _RESHARD_AFTER_FORWARD
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = bool(forward_prefetch)
        self._limit_all_gathers = bool(limit_all_gathers)
        self._param_init_fn = param_init_fn
        self._sync_module_states = bool(sync_module_states)
        self._device = _resolve_device(device_id, module, _unit_name)
        self._device_id_given = device_id is not None
        self._unit_name = _unit_name

        ignored = _expand_ignored(ignored_modules, module)
        ignored_params = {p for m in ignored for p in m.parameters(recurse=False)}

        if auto_wrap_policy is not None:
            child_kwargs = dict(
                # The resolved groups: children must not create groups of their own.
                process_group=(shard_group, replicate_group) if replicate_group is not None else shard_group,
                sharding_strategy=strategy,
                backward_prefetch=backward_prefetch,
                ignored_modules=ignored,
                device_id=device_id,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                param_init_fn=param_init_fn,
                sync_module_states=sync_module_states,
            )
            names = {m: name for name, m in module.named_modules()}
            plan = _plan_wraps(
                module,
                auto_wrap_policy,
                ignored,
                ignored_params,
                lambda m: isinstance(m, FullyShardedDataParallel),
            )
            parents = _parent_slots(module)
            for target, overrides in plan:
                parent, attr = parents[target]
                name = _join(_unit_name, names[target])
                setattr(parent, attr, FullyShardedDataParallel(target, **{**child_kwargs, **overrides}, _unit_name=name))

        self._fsdp_wrapped_module = module
        self._build_flat_param(module, ignored, ignored_params)

        # Set by the root at lazy init (see _lazy_init).
        self._is_root: bool | None = None
        self._root: FullyShardedDataParallel | None = None
        self._scheduler: Any = None
        self._units: list[FullyShardedDataParallel] = []
        self._in_summon = False
        self._state_dict_config = FullStateDictConfig()
        self._optim_state_dict_config = FullOptimStateDictConfig()
        self._register_load_state_dict_pre_hook(self._pre_load_state_dict)
        self.register_load_state_dict_post_hook(self._post_load_state_dict)
        # Live uses of this unit's parameters (see _Use and [Note: Pending uses]).
        self._uses: weakref.WeakSet[_Use] = weakref.WeakSet()
        # Whether the modules hold the storage-less placeholders (see _reshard).
        self._placeholders_set = True
        self._sync_gradients = True
        # Root only, per iteration (see [Note: Unit lifecycle]).
        self._final_callback_queued = False
        self._backward_task = -1  # the graph task of the backward under way
        self._in_iteration = False
        self._pre_forward_order: list[FullyShardedDataParallel] = []
        self._prev_pre_forward_order: list[FullyShardedDataParallel] = []
        self._post_forward_order: list[FullyShardedDataParallel] = []

    # ------------------------------------------------------------------ setup

    def _build_flat_param(
        self, module: nn.Module, ignored: set[nn.Module], ignored_params: set[nn.Parameter]
    ) -> None:
        """Collects the unit's parameters, materializes and moves them, flattens and shards."""
        unit_modules = list(_unit_modules(module, ignored))
        if self._param_init_fn is not None and _has_meta(unit_modules):
            meta_originals = _materialize_with(self._param_init_fn, unit_modules, self._unit_name)
            if not self._device_id_given:  # as torch: the device param_init_fn chose
                real = [t for _, m in unit_modules for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
                if real:
                    self._device = real[0].device
        else:
            meta_originals = _materialize_meta(unit_modules, self._device, self._unit_name)
        for _, m in unit_modules:  # buffers go where the parameters go (torch moves the whole module)
            for attr, b in m._buffers.items():
                if b is not None and b.device != self._device:
                    m._buffers[attr] = b.to(self._device)

        params: list[nn.Parameter] = []
        names: list[str] = []
        local_names: list[str] = []  # relative to this unit's module (its own name may change at lazy init)
        slots: list[tuple[nn.Module, str, int]] = []  # (module, attribute, index into params)
        index_of: dict[int, int] = {}
        for prefix, m in unit_modules:
            for attr, p in m._parameters.items():
                if p is None or p in ignored_params:
                    continue
                fqn = _join(self._unit_name, _join(prefix, attr))
                _check_not_owned(p, fqn)
                if id(p) not in index_of:
                    index_of[id(p)] = len(params)
                    params.append(p)
                    names.append(fqn)
                    local_names.append(_join(prefix, attr))
                slots.append((m, attr, index_of[id(p)]))

        self._param_slots = slots
        self._param_names = names
        self._param_local_names = local_names
        self._handle = None
        if params:
            _check_uniform(params, names, self._unit_name)
        if params and params[0].device != self._device:
            with torch.no_grad():
                for p in params:
                    p.data = p.data.to(self._device)
        if self._sync_module_states:
            buffers = list({id(b): b for _, m in unit_modules for b in m._buffers.values() if b is not None}.values())
            for group in (self._process_group, self._replicate_group):
                if group is not None:
                    _broadcast_from_first_rank([p.detach() for p in params] + buffers, group)
        if not params:
            return
        for p, fqn in zip(params, names):
            setattr(p, _OWNER_ATTR, (self._unit_name, fqn))
            if id(p) in meta_originals:  # other units may still hold the meta original
                setattr(meta_originals[id(p)], _OWNER_ATTR, (self._unit_name, fqn))
        layout = _C.FlatParamLayout([list(p.shape) for p in params], self._shard_factor)
        with torch.no_grad():
            shard_rank = self._rank if self._shard_factor > 1 else 0
            self._handle = _C.FlatParam(self._unit_name, layout, shard_rank, [p.detach() for p in params])
        flat = nn.Parameter(self._handle.local_shard, requires_grad=params[0].requires_grad)
        self._handle.set_local_shard(flat)
        self.register_parameter(_FLAT_PARAM, flat)
        # The module attributes become plain tensors: views of the unsharded
        # buffer (storage-less while sharded, see [Note: Unsharded storage]).
        for m, attr, _ in slots:
            del m._parameters[attr]
        self._set_views(self._handle.placeholder_views, placeholders=True)

    def _set_views(self, views, placeholders: bool = False) -> None:
        for m, attr, index in self._param_slots:
            m.__dict__[attr] = views[index]
        # Straight into __dict__: nn.Module.__setattr__ costs microseconds, three times a unit a step.
        self.__dict__["_placeholders_set"] = placeholders

    def _reshard(self) -> None:
        """Frees the unsharded buffer; the modules get storage-less placeholders back
        (which also lets go of the last forward's views and their graph)."""
        self._scheduler.reshard(self._handle)
        self._set_views(self._handle.placeholder_views, placeholders=True)

    def _lazy_init(self) -> None:
        """Makes this unit the root of every unit below it; creates the shared scheduler."""
        if self._is_root is not None:
            return
        units = []
        for name, m in self.named_modules():
            if isinstance(m, FullyShardedDataParallel):
                if m._is_root is not None:
                    raise RuntimeError(
                        f"FullyShardedDataParallel: unit '{_clean_name(name)}' ran forward on its own "
                        f"before its root; call the outermost FSDP module's forward."
                    )
                units.append((_clean_name(name), m))
        for name, unit in units:
            for attr, what in (("_device", "device_id"), ("_limit_all_gathers", "limit_all_gathers")):
                if getattr(unit, attr) != getattr(self, attr):
                    raise ValueError(
                        f"FullyShardedDataParallel: unit '{name}' has {what}={getattr(unit, attr)} but its root "
                        f"has {getattr(self, attr)}; the units of one root share one runtime. Wrap them "
                        f"with the same {what}."
                    )
            if unit._process_group is not self._process_group or unit._replicate_group is not self._replicate_group:
                raise NotImplementedError(
                    f"FullyShardedDataParallel: unit '{name}' uses other process groups than its root; "
                    f"flatshard runs all units of one root over the root's groups. Give every unit the "
                    f"same process_group."
                )
        scheduler = _C.Scheduler(
            self._process_group, self._replicate_group, self._device, _all_gather_limit(self._limit_all_gathers)
        )
        for name, unit in units:
            unit._is_root = unit is self
            # Not a submodule: through __dict__, so the module tree stays a tree.
            unit.__dict__["_root"] = self
            unit._scheduler = scheduler
            unit._unit_name = name
            if unit._handle is not None:
                unit._handle.name = name
        self._units = [u for _, u in units]

    # ---------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_root is None:
            self._lazy_init()
        if self._in_summon:
            raise RuntimeError(
                "FullyShardedDataParallel: forward() inside summon_full_params() is not supported; "
                "leave the context first."
            )
        if _in_backward():
            return self._recompute(args, kwargs)
        root = self._root
        if self._is_root:
            if root._final_callback_queued:
                root._abort_backward()
            if not root._in_iteration:
                root._in_iteration = True
                root._prev_pre_forward_order = root._pre_forward_order
                root._pre_forward_order = []
                root._post_forward_order = []
            if self._device.type != "cpu":
                args, kwargs = _to_device((args, kwargs), self._device)
        handle = self._handle
        grad_enabled = torch.is_grad_enabled()
        scheduler = self._scheduler
        position = len(root._pre_forward_order)
        root._pre_forward_order.append(self)
        use = None
        if handle is not None:
            # Waiting first lets the backend drop its temporaries for this
            # all-gather before the next one is issued (on devices with
            # events the wait only orders streams: no overlap is lost).
            scheduler.wait_for_unshard(handle)
            if self._forward_prefetch:
                _prefetch(scheduler, root._prev_pre_forward_order, position + 1, backward=False)
            flat = self._flat_param
            if grad_enabled and flat.requires_grad:
                use = _Use(self)
                self._set_views(_UnshardedViews.apply(self, use, flat))
            else:
                self._set_views(handle.views())

        output = self._fsdp_wrapped_module(*args, **kwargs)

        if handle is not None and grad_enabled and not self._flat_param.requires_grad:
            # A frozen unit has no post-backward: its backward is over once
            # its inputs' gradients are computed.
            inputs = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(inputs, self._frozen_post_backward, mode="all")
        if handle is not None and (
            not grad_enabled
            or (
                self._reshard_after_forward
                and not self._is_root
                and self._sync_gradients
                and not handle.is_replicated  # nothing to free: keep the views for backward
            )
        ):
            self._reshard()
        if not grad_enabled:
            if self._is_root:
                # No backward follows: end the iteration with nothing unsharded
                # (forward-prefetched units included).
                root._in_iteration = False
                for unit in root._units:
                    if unit._handle is not None and unit._sync_gradients:
                        unit._reshard()
            return output
        order = root._post_forward_order
        index = len(order)
        order.append(self)
        if use is not None:
            use.order, use.index = order, index
        # The hook keeps the order and the index, not the use: only the views'
        # node may keep a use alive (a node that cannot run is no pending use).
        hook = functools.partial(self._pre_backward, order, index)
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if len(tensors) == 1:  # the common case, and much cheaper than a multi-grad hook
            tensors[0].register_hook(hook)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return output

    def _recompute(self, args: tuple, kwargs: dict) -> Any:
        """forward() during backward: activation checkpointing reruns this unit (see [Note: Recomputation])."""
        if self._handle is not None:
            self._scheduler.wait_for_unshard(self._handle)
            self._hand_out_views()
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _hand_out_views(self) -> None:
        """Fresh autograd views of the unsharded buffer, through a speculative use (see [Note: Recomputation])."""
        if not self._flat_param.requires_grad:
            self._set_views(self._handle.views())
            return
        use = _Use(self, speculative=True)
        with torch.enable_grad():
            self._set_views(_UnshardedViews.apply(self, use, self._flat_param))

    def _has_pending_uses(self) -> bool:
        """Whether a use of this unit still runs its post-backward in this backward (see [Note: Pending uses])."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        nested = task != self._root._backward_task
        for use in list(self._uses):
            if use.done or use.speculative or use.node is None:
                continue
            node = use.node()
            if node is not None and (nested or torch._C._will_engine_execute_node(node)):
                return True
        return False

    # --------------------------------------------------------------- backward

    def _pre_backward(self, order: list["FullyShardedDataParallel"], index: int, _grad: Any = None) -> None:
        root = self._root
        if not root._final_callback_queued:
            root._final_callback_queued = True
            root._backward_task = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)
        if self._handle is not None:
            self._scheduler.wait_for_unshard(self._handle)  # see forward() on the order
            if self._placeholders_set:  # resharded after forward: recomputation needs real views
                self._hand_out_views()
            if self._backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
                _prefetch(self._scheduler, order, index - 1, backward=True)

    def _post_backward(self, use: _Use, grads: tuple[torch.Tensor | None, ...]) -> None:
        use.finish()
        # Reduce once no other use still needs the parameters, unless in no_sync().
        reduce = self._sync_gradients and not self._has_pending_uses()
        self._scheduler.post_backward(
            self._handle, list(grads), reduce, self._divide_factor, self._replicate_group is not None
        )
        if not reduce:
            return
        if self._backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            _prefetch(self._scheduler, use.order, use.index - 1, backward=True)
        self._reshard()

    def _frozen_post_backward(self, _grads: Any) -> None:
        if self._sync_gradients:
            self._reshard()

    def _reduce_grad(self) -> None:
        self._scheduler.reduce_grad(self._handle, self._divide_factor, self._replicate_group is not None)

    def _finish_backward(self) -> None:
        """Root only, end of backward: gradient shards written, nothing unsharded (unless no_sync)."""
        self._final_callback_queued = False
        self._in_iteration = False
        for unit in self._units:  # the same order on every rank
            handle = unit._handle
            for use in list(unit._uses):
                use.finish()  # a later backward through a kept graph is a new reduction
            if handle is not None and unit._sync_gradients and handle.has_unsharded_grad():
                unit._reduce_grad()  # a use whose post-backward never ran
        self._scheduler.finish_grad_sync()
        for unit in self._units:
            if unit._handle is not None and unit._sync_gradients:
                unit._reshard()

    def _abort_backward(self) -> None:
        """Root only: the last backward raised before its end. Drops its partial gradients."""
        logger.warning(
            "flatshard: the previous backward did not finish (it raised); every unit's gradient "
            "(.grad and what no_sync() accumulated) is dropped, so that no rank steps on part of a "
            "batch. Only safe when every rank's backward raised at the same point."
        )
        self._final_callback_queued = False
        self._in_iteration = False
        self._scheduler.abort_grad_sync()
        for unit in self._units:
            for use in list(unit._uses):
                use.finish()
            if unit._handle is not None:
                unit._handle.drop_unsharded_grad()
                unit._flat_param.grad = None
                unit._reshard()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally, with no communication, inside the context.

        Call it on the root. The first backward after leaving the context
        reduces the accumulated gradients once. See [Note: no_sync] for the
        memory this costs.
        """
        if self._is_root is None:
            self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                f"FullyShardedDataParallel.no_sync: expected the root unit but '{self._unit_name}' is "
                f"nested; call no_sync() on the outermost FSDP module."
            )
        previous = [(u, u._sync_gradients) for u in self._units]
        for unit in self._units:
            unit._sync_gradients = False
        try:
            yield
        finally:
            for unit, value in previous:
                unit._sync_gradients = value

    # ------------------------------------------------------- torch's methods

    def _apply(self, fn: Callable, recurse: bool = True) -> "FullyShardedDataParallel":
        # .to(), .cuda(), .double() and friends: a no-op passes; a move or cast
        # would leave the runtime's buffers behind, so it is refused.
        flat = self._parameters.get(_FLAT_PARAM)
        if flat is not None:
            probe = fn(torch.empty(0, dtype=flat.dtype, device=flat.device))
            if probe.dtype != flat.dtype or probe.device != flat.device:
                raise ValueError(
                    f"FullyShardedDataParallel: unit '{self._unit_name or '<root>'}': expected no move or "
                    f"cast after wrapping but got {flat.dtype} on {flat.device} -> {probe.dtype} on "
                    f"{probe.device}. Move or cast the module before wrapping it (device_id= moves it "
                    f"at wrap time)."
                )
        return super()._apply(fn, recurse)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Like ``nn.Module.named_parameters``, without the wrapper's prefix in names."""
        for name, p in super().named_parameters(*args, **kwargs):
            yield _clean_name(name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``nn.Module.named_buffers``, without the wrapper's prefix in names."""
        for name, b in super().named_buffers(*args, **kwargs):
            yield _clean_name(name), b

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``fn`` on every submodule and then this one, as ``nn.Module.apply``, with full parameters.

        As torch's FSDP does: each unit's full parameters are summoned while
        ``fn`` runs over its modules and written back to the shards after
        (e.g. ``model.apply(init_weights)`` after wrapping). Collective.
        """
        uninitialized = self._is_root is None
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            out = super().apply(fn)
        if uninitialized:
            # Summoning made this unit a root; it may not be the real one (apply
            # on inner units before wrapping their parent): decide at the first forward.
            for _, unit in self.named_modules():
                if isinstance(unit, FullyShardedDataParallel):
                    unit._is_root = None
                    unit.__dict__["_root"] = None
                    unit._scheduler = None
                    unit._units = []
        return out

    def check_is_root(self) -> bool:
        """Whether this unit is the root (lazy-initializes if no forward ran yet)."""
        if self._is_root is None:
            self._lazy_init()
        return bool(self._is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FSDP unit in ``module`` (only the outermost ones with ``root_only``)."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            inner = {id(m) for u in units for m in u.modules() if m is not u}
            units = [u for u in units if id(u) not in inner]
        return units

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Exposes the full, unsharded original parameters of ``module``'s units.

        Inside the context every original parameter is an ``nn.Parameter`` again
        under its own name and ``named_parameters()`` lists them instead of the
        flat shards. With ``writeback`` (default), changes made to them inside
        are copied back into the local shards on exit. Collective: every rank
        must enter.
        """
        for arg, value in (("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu), ("with_grads", with_grads)):
            if value:
                raise NotImplementedError(
                    f"summon_full_params: {arg}=True is not implemented in flatshard yet."
                )
        if isinstance(module, FullyShardedDataParallel):
            roots = [module]
        else:
            roots = FullyShardedDataParallel.fsdp_modules(module, root_only=True)
        for root in roots:
            if root._is_root is None:
                root._lazy_init()
        units = FullyShardedDataParallel.fsdp_modules(module) if recurse else roots
        units = [u for u in units if not u._in_summon]
        if _in_backward():
            raise RuntimeError(
                "summon_full_params: called during backward; call it between iterations."
            )
        for root in roots:
            if root._final_callback_queued:
                root._abort_backward()
        entered: list[tuple[FullyShardedDataParallel, list[nn.Parameter]]] = []
        try:
            for unit in units:
                entered.append((unit, unit._expose_full_params()))
            yield
        finally:
            for unit, full in reversed(entered):
                unit._hide_full_params(full, writeback)

    def _expose_full_params(self) -> list[nn.Parameter]:
        self._in_summon = True
        handle = self._handle
        if handle is None:
            return []
        self._scheduler.unshard(handle)
        self._scheduler.wait_for_unshard(handle)
        flat = self._parameters.pop(_FLAT_PARAM)
        full = [nn.Parameter(v, requires_grad=flat.requires_grad) for v in handle.views()]
        for m, attr, index in self._param_slots:
            m.__dict__.pop(attr, None)
            m._parameters[attr] = full[index]
        self.__dict__["_summoned_flat_param"] = flat
        return full

    def _hide_full_params(self, full: list[nn.Parameter], writeback: bool) -> None:
        self._in_summon = False
        handle = self._handle
        if handle is None:
            return
        flat = self.__dict__.pop("_summoned_flat_param")
        for m, attr, _ in self._param_slots:
            m._parameters.pop(attr, None)
        self.register_parameter(_FLAT_PARAM, flat)
        if writeback:
            begin, end = handle.layout.shard_range(handle.rank)
            with torch.no_grad():
                flat.copy_(handle.unsharded[begin:end])
        # Parameters a caller kept from inside the context must not read freed
        # storage: they become empty (clone inside the context to keep values).
        for p in full:
            p.data = p.data.new_empty(0)
        self._reshard()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clips the gradient norm of every parameter, viewed as one vector, in place.

        Call it on the root, after backward. The norm combines the local
        gradient shards over the shard group (a collective: every rank must
        call it); a replicated unit's gradient (NO_SHARD), and ignored modules'
        gradients, count once. Returns the total norm (same on every rank).
        ``torch.nn.utils.clip_grad_norm_`` on ``model.parameters()`` would see
        only this rank's shards.
        """
        if self._is_root is None:
            self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                f"FullyShardedDataParallel.clip_grad_norm_: expected the root unit but '{self._unit_name}' "
                f"is nested; call it on the outermost FSDP module."
            )
        norm_type = float(norm_type)
        sharded, replicated = [], []
        managed = set()
        for unit in self._units:
            if unit._handle is None:
                continue
            managed.add(id(unit._flat_param))
            if unit._flat_param.grad is not None:
                (replicated if unit._handle.is_replicated else sharded).append(unit._flat_param.grad)
        replicated += [p.grad for p in self.parameters() if id(p) not in managed and p.grad is not None]
        grads = sharded + replicated
        dtype = grads[0].dtype if grads else torch.float32
        for g in grads[1:]:
            dtype = torch.promote_types(dtype, g.dtype)

        def local(gs: list[torch.Tensor]) -> torch.Tensor:
            if not gs:
                return torch.zeros((), device=self._device)
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in gs])
            return norms.max() if norm_type == math.inf else (norms**norm_type).sum()

        shard_part, replicated_part = local(sharded), local(replicated)
        if norm_type == math.inf:
            dist.all_reduce(shard_part, op=dist.ReduceOp.MAX, group=self._process_group)
            total = torch.maximum(shard_part, replicated_part)
        else:
            dist.all_reduce(shard_part, group=self._process_group)
            total = (shard_part + replicated_part) ** (1.0 / norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.to(dtype)

    # ------------------------------------------------------------ state dicts
    # [Note: State dicts]
    # StateDictType.FULL_STATE_DICT, torch's default: state_dict() gathers the
    # full parameters (a collective: every rank calls it) and returns them
    # under the original module's names, as a plain model's state_dict() would
    # (tied parameters under each of their names); FullStateDictConfig's
    # offload_to_cpu and rank0_only are honoured. load_state_dict() takes such
    # a dict and writes every rank's shards. Nested units called from their
    # root's state_dict() (inside summon_full_params) behave as plain modules.

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The full state dict under the original names (see [Note: State dicts]). Collective.

        Also called by a plain parent module's ``state_dict()`` (with its
        ``destination`` and ``prefix``): the entries go there.
        """
        if self._in_summon:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if args:
            raise ValueError(
                "FullyShardedDataParallel.state_dict: positional arguments are not supported; pass "
                "destination=, prefix= and keep_vars= by name."
            )
        config = self._state_dict_config
        out = destination if destination is not None else collections.OrderedDict()
        keep = not config.rank0_only or dist.get_rank() == 0
        with FullyShardedDataParallel.summon_full_params(self, writeback=False):
            full = super().state_dict(prefix=prefix, keep_vars=keep_vars)
            if keep:
                for name, value in full.items():
                    if isinstance(value, torch.Tensor):
                        # Plain tensors, cloned: the summoned storage is freed on exit.
                        value = value.detach().clone()
                        if config.offload_to_cpu:
                            value = value.cpu()
                    out[_clean_name(name)] = value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads a full state dict (original names) into every rank's shards (see [Note: State dicts])."""
        if assign and not self._in_summon:
            raise NotImplementedError(
                "FullyShardedDataParallel.load_state_dict: assign=True is not implemented in flatshard; "
                "load with assign=False (values are copied into the shards)."
            )
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        return type(result)(
            [_clean_name(k) for k in result.missing_keys], [_clean_name(k) for k in result.unexpected_keys]
        )

    def _pre_load_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        # Runs before this module loads, also under a plain parent's load_state_dict():
        # the outermost unit summons the full parameters and renames the original
        # names to the wrapped ones; _post_load_state_dict writes the shards back.
        if self._in_summon:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(FullyShardedDataParallel.summon_full_params(self, writeback=True))
        self.__dict__["_load_stack"] = stack
        for actual in super().state_dict(keep_vars=True):
            clean = _clean_name(actual)
            if clean != actual and prefix + clean in state_dict:
                state_dict[prefix + actual] = state_dict.pop(prefix + clean)

    def _post_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        stack = self.__dict__.pop("_load_stack", None)
        if stack is not None:
            stack.close()

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> StateDictSettings:
        """Sets the state dict type of every unit in ``module``; returns the previous settings (as torch).

        flatshard implements StateDictType.FULL_STATE_DICT (torch's default) with
        FullStateDictConfig and FullOptimStateDictConfig; other types raise
        NotImplementedError.
        """
        if state_dict_type != StateDictType.FULL_STATE_DICT:
            raise NotImplementedError(
                f"FullyShardedDataParallel.set_state_dict_type: {state_dict_type} is not implemented in "
                f"flatshard yet; use StateDictType.FULL_STATE_DICT."
            )
        configs = []
        for config, cls in ((state_dict_config, FullStateDictConfig), (optim_state_dict_config, FullOptimStateDictConfig)):
            config = cls() if config is None else config
            if not isinstance(config, cls):
                raise ValueError(
                    f"FullyShardedDataParallel.set_state_dict_type: expected a {cls.__name__} for "
                    f"FULL_STATE_DICT but got {config!r}"
                )
            configs.append(config)
        state_dict_config, optim_state_dict_config = configs
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not units:
            raise ValueError("set_state_dict_type: expected a module with FSDP units but found none")
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        for unit in units:
            unit._state_dict_config = state_dict_config
            unit._optim_state_dict_config = optim_state_dict_config
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state dict settings of the units in ``module`` (always FULL_STATE_DICT)."""
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not units:
            raise ValueError("get_state_dict_type: expected a module with FSDP units but found none")
        unit = units[0]
        return StateDictSettings(StateDictType.FULL_STATE_DICT, unit._state_dict_config, unit._optim_state_dict_config)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> Iterator[None]:
        """Within the context, the units of ``module`` use this state dict type and config."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, previous.state_dict_type, previous.state_dict_config, previous.optim_state_dict_config
            )

    # [Note: Optimizer state dicts]
    # FULL_STATE_DICT format, as torch's FSDP1 writes it: {"state": {original
    # parameter name: {key: value}}, "param_groups": [{..., "params": [names]}]}.
    # The optimizer steps the flat shards, so a state tensor shaped like a shard
    # (Adam's moments) is all-gathered over the shard group, its padding dropped
    # and split at the layout's offsets into one tensor per original parameter;
    # anything else (a scalar ``step``) is repeated for each. A tied parameter
    # appears once, under its first name. Loading is the reverse: each rank
    # concatenates a unit's entries in flat order, pads, and keeps its shard.

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The optimizer's state under the original parameter names (see [Note: Optimizer state dicts]).

        Collective over every unit's group: every rank must call it.
        ``optim_state_dict`` defaults to ``optim.state_dict()``. The units'
        FullOptimStateDictConfig applies: ``offload_to_cpu`` (default True)
        and ``rank0_only`` (other ranks get ``{}``).
        """
        if group is not None:
            raise NotImplementedError(
                "FullyShardedDataParallel.optim_state_dict: group= is not implemented in flatshard; the "
                "units' own groups are used."
            )
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        entries, config = _optim_entries(model, optim, "optim_state_dict")
        _check_same_state_keys(entries, osd)
        keep = not config.rank0_only or dist.get_rank() == 0
        state: dict[str, dict[str, Any]] = {}
        names_of: dict[int, list[str]] = {}
        for index, entry in enumerate(entries):
            values = osd["state"].get(index, {})
            names_of[index] = entry.names
            full = {entry.names[0]: dict(values)} if entry.unit is None else _unflatten_state(entry, values)
            if keep:
                for name, per_param in full.items():
                    if per_param:
                        state[name] = {
                            k: (v.detach().clone().cpu() if config.offload_to_cpu else v.detach().clone())
                            if isinstance(v, torch.Tensor) else v
                            for k, v in per_param.items()
                        }
        if not keep:
            return {}
        groups = []
        for g in osd["param_groups"]:
            g = dict(g)
            g["params"] = [name for index in g["params"] for name in names_of[index]]
            groups.append(g)
        return {"state": state, "param_groups": groups}

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Turns a state dict from ``optim_state_dict`` (ours or torch's FSDP1, FULL) into one for ``optim``.

        Each rank keeps its shard of every unit's state. With the units'
        ``rank0_only`` config only rank 0 needs to pass the dict (it is
        broadcast). ``load_directly`` also loads it into ``optim``.
        """
        if is_named_optimizer or group is not None:
            raise NotImplementedError(
                "FullyShardedDataParallel.optim_state_dict_to_load: is_named_optimizer and group= are not "
                "implemented in flatshard."
            )
        entries, config = _optim_entries(model, optim, "optim_state_dict_to_load")
        if config.rank0_only:
            if dist.get_rank() == 0:  # on the CPU: pickled tensors would land on rank 0's device
                optim_state_dict = torch.utils._pytree.tree_map_only(
                    torch.Tensor, lambda t: t.detach().cpu(), optim_state_dict
                )
            box = [optim_state_dict if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            optim_state_dict = box[0]
        if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
            raise ValueError(
                "FullyShardedDataParallel.optim_state_dict_to_load: expected the dict that "
                "FSDP.optim_state_dict() returns ({'state': ..., 'param_groups': ...}) but got "
                f"{type(optim_state_dict).__name__} with keys {sorted(optim_state_dict) if isinstance(optim_state_dict, dict) else '-'}"
            )
        full_state = optim_state_dict["state"]
        known = {n for entry in entries for n in entry.names}
        unknown = [k for k in full_state if k not in known]
        if unknown:
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict has state for "
                f"{unknown[:3]}{' and more' if len(unknown) > 3 else ''}, which are not parameters of the "
                f"model (its names: {sorted(known)[:3]}...); pass the dict FSDP.optim_state_dict() returned "
                f"for this model, not optim.state_dict()."
            )
        state: dict[int, dict[str, Any]] = {}
        for index, entry in enumerate(entries):
            names = entry.names
            present = [n for n in names if n in full_state]
            if not present:
                continue
            if len(present) != len(names):
                missing = [n for n in names if n not in full_state]
                raise ValueError(
                    f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict has state for "
                    f"'{present[0]}' but not for {missing}, which the optimizer steps as one flat "
                    f"parameter (unit '{entry.unit._unit_name or '<root>'}'); save and load the whole model's "
                    f"optimizer state."
                )
            device = entry.param.device
            if entry.unit is None:
                state[index] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in full_state[names[0]].items()}
            else:
                state[index] = _flatten_state(entry, [full_state[n] for n in names], device)
        groups = []
        saved_groups = optim_state_dict["param_groups"]
        if len(saved_groups) != len(optim.param_groups):
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: the state dict has {len(saved_groups)} "
                f"param groups but the optimizer has {len(optim.param_groups)}."
            )
        position = 0
        for saved, current in zip(saved_groups, optim.param_groups):
            g = {k: v for k, v in saved.items() if k != "params"}
            g["params"] = list(range(position, position + len(current["params"])))
            position += len(current["params"])
            groups.append(g)
        result = {"state": state, "param_groups": groups}
        if load_directly:
            optim.load_state_dict(result)
        return result

    def _not_yet(name: str) -> Callable:  # noqa: N805 - builds methods below
        def method(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"FullyShardedDataParallel.{name}() is not implemented in flatshard yet; "
                f"use torch.distributed.fsdp for this, or FSDP.summon_full_params() to reach the full "
                f"parameters."
            )

        method.__name__ = name
        method.__doc__ = "Not implemented in flatshard yet: raises NotImplementedError."
        return method

    for _name in (
        "register_comm_hook",
        "full_optim_state_dict",
        "sharded_optim_state_dict",
        "shard_full_optim_state_dict",
        "scatter_full_optim_state_dict",
        "flatten_sharded_optim_state_dict",
        "rekey_optim_state_dict",
    ):
        locals()[_name] = _not_yet(_name)
    del _name, _not_yet


# ------------------------------------------------------------------ helpers


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _prefetch(scheduler: Any, order: list["FullyShardedDataParallel"], index: int, backward: bool) -> None:
    """Issues the all-gather of ``order[index]`` without waiting, if it exists, is sharded
    and (in backward) still has a use whose backward has not run."""
    if 0 <= index < len(order):
        unit = order[index]
        handle = unit._handle
        if handle is not None and handle.state == _SHARDED and (not backward or unit._has_pending_uses()):
            scheduler.unshard(handle)


def _all_gather_limit(limit_all_gathers: bool) -> int:
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


def _resolve_groups(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group or None) from torch's process_group/device_mesh arguments."""
    hybrid = strategy in _HYBRID
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError(
                "FullyShardedDataParallel: expected process_group or device_mesh but got both; pass one."
            )
        if hybrid:
            if device_mesh.ndim != 2:
                raise ValueError(
                    f"FullyShardedDataParallel: {strategy}: expected a 2-D device_mesh (replicate, shard) "
                    f"but got {device_mesh.ndim} dimensions"
                )
            return device_mesh.get_group(mesh_dim=1), device_mesh.get_group(mesh_dim=0)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy}: expected a 1-D device_mesh but got "
                f"{device_mesh.ndim} dimensions; 2-D meshes are for HYBRID_SHARD"
            )
        return device_mesh.get_group(), None
    if isinstance(process_group, tuple):
        if not hybrid:
            raise ValueError(
                f"FullyShardedDataParallel: a (shard_group, replicate_group) process_group is for "
                f"HYBRID_SHARD or _HYBRID_SHARD_ZERO2 but sharding_strategy is {strategy}; pass one group."
            )
        if len(process_group) != 2:
            raise ValueError(
                f"FullyShardedDataParallel: process_group: expected (shard_group, replicate_group) but got "
                f"a tuple of {len(process_group)}"
            )
        return process_group[0], process_group[1]
    if hybrid:
        if process_group is not None:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy} needs a (shard_group, replicate_group) tuple or a "
                f"2-D device_mesh, not one process group; or pass neither to shard within each host."
            )
        return _per_host_groups()
    return (process_group if process_group is not None else dist.group.WORLD), None


def _per_host_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Hybrid default: shard within each host, replicate across hosts (every rank builds every group)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (
        torch.cuda.device_count() if torch.cuda.is_available() else world
    )
    if local < 1 or world % local:
        raise ValueError(
            f"FullyShardedDataParallel: hybrid sharding per host: expected the world size {world} to be a "
            f"multiple of the ranks per host ({local}); pass process_group=(shard_group, replicate_group)."
        )
    shard = replicate = None
    for start in range(0, world, local):
        group = dist.new_group(list(range(start, start + local)))
        if start <= rank < start + local:
            shard = group
    for offset in range(local):
        group = dist.new_group(list(range(offset, world, local)))
        if rank % local == offset:
            replicate = group
    return shard, replicate


def _resolve_device(device_id: int | torch.device | None, module: nn.Module, unit_name: str) -> torch.device:
    if device_id is None:
        real = [t.device for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta"]
        if real:
            return real[0]
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if isinstance(device_id, torch.device):
        if device_id.type == "cuda" and device_id.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device_id
    raise ValueError(
        f"FullyShardedDataParallel: device_id: expected an int, a torch.device or None but got "
        f"{device_id!r}"
    )


def _expand_ignored(ignored_modules: Iterable[nn.Module] | None, root: nn.Module) -> set[nn.Module]:
    if ignored_modules is None:
        return set()
    out: set[nn.Module] = set()
    for m in ignored_modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"ignored_modules: expected nn.Module instances but got {m!r}")
        if isinstance(m, FullyShardedDataParallel):
            raise ValueError("ignored_modules: expected plain modules but got an FSDP unit")
        out.update(m.modules())
    if root in out:
        raise ValueError("ignored_modules: the module being wrapped cannot itself be ignored")
    return out


def _parent_slots(root: nn.Module) -> dict[nn.Module, tuple[nn.Module, str]]:
    slots: dict[nn.Module, tuple[nn.Module, str]] = {}
    for parent in root.modules():
        for attr, child in parent.named_children():
            slots.setdefault(child, (parent, attr))
    return slots


def _unit_modules(module: nn.Module, ignored: set[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """(relative name, module) for the modules a unit owns: its subtree minus inner units and ignored ones."""
    stack = [("", module)]
    seen: set[int] = set()
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield prefix, m
        children = [
            (_join(prefix, name), c)
            for name, c in m.named_children()
            if not isinstance(c, FullyShardedDataParallel) and c not in ignored
        ]
        stack.extend(reversed(children))


def _materialize_meta(
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
            name = _join(unit_name, prefix) or type(m).__name__
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
            if p is None or not p.is_meta or hasattr(p, _OWNER_ATTR):
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


class _OptimEntry:
    """One parameter the optimizer steps: a unit's flat shard (``unit`` set; ``names`` in flat
    order) or a plain parameter (``names`` is its one name)."""

    def __init__(self, param: nn.Parameter, unit: "FullyShardedDataParallel | None", names: list[str]):
        self.param, self.unit, self.names = param, unit, names


def _optim_entries(model: nn.Module, optim: torch.optim.Optimizer, what: str) -> tuple[list[_OptimEntry], Any]:
    """The optimizer's parameters in its order, each with its original name(s); and the optim config."""
    units = FullyShardedDataParallel.fsdp_modules(model)
    if not units:
        raise ValueError(f"FullyShardedDataParallel.{what}: expected a model with FSDP units but found none")
    for root in FullyShardedDataParallel.fsdp_modules(model, root_only=True):
        if root._is_root is None:
            root._lazy_init()
    unit_of = {id(u._flat_param): u for u in units if u._handle is not None}
    # Names relative to ``model``: the unit's path in it, then the parameter's path in the unit.
    path_of = {id(m): _clean_name(n) for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)}
    plain_names: dict[int, str] = {}
    for name, p in model.named_parameters():
        if id(p) not in unit_of:
            plain_names.setdefault(id(p), _clean_name(name))
    entries = []
    for group_ in optim.param_groups:
        for p in group_["params"]:
            unit = unit_of.get(id(p))
            if unit is None:
                if id(p) not in plain_names:
                    raise ValueError(
                        f"FullyShardedDataParallel.{what}: the optimizer steps a parameter of shape "
                        f"{tuple(p.shape)} that is not in the model; pass the model the optimizer was built for."
                    )
                entries.append(_OptimEntry(p, None, [plain_names[id(p)]]))
                continue
            entries.append(_OptimEntry(p, unit, [_join(path_of[id(unit)], n) for n in unit._param_local_names]))
    return entries, units[0]._optim_state_dict_config


def _check_same_state_keys(entries: list[_OptimEntry], osd: dict[str, Any]) -> None:
    """Every rank must have the same state keys per unit, or the gathers below would not pair up."""
    mine = [sorted(osd["state"].get(i, {})) if e.unit is not None and not e.unit._handle.is_replicated else None
            for i, e in enumerate(entries)]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        for entry, a, b in zip(entries, mine, theirs):
            if a != b:
                raise ValueError(
                    f"FullyShardedDataParallel.optim_state_dict: unit '{entry.unit._unit_name or '<root>'}' has "
                    f"optimizer state {a} on rank {dist.get_rank()} but {b} on rank {rank}; every rank must "
                    f"step the same parameters before saving (e.g. call optim.step() on every rank)."
                )


def _unflatten_state(entry: _OptimEntry, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One unit's flat-shard optimizer state as full per-parameter state. Collective over its shard group."""
    unit = entry.unit
    handle = unit._handle
    layout = handle.layout
    per_param: dict[str, dict[str, Any]] = {n: {} for n in entry.names}

    def per_element(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == entry.param.shape

    # torch's order: the per-element state, then the rest (each in the optimizer's order,
    # which is the same on every rank: the collectives below follow it).
    keys = [k for k in values if per_element(values[k])] + [k for k in values if not per_element(values[k])]
    for key in keys:
        value = values[key]
        if per_element(value):
            flat = value.detach()
            if not handle.is_replicated:
                gathered = flat.new_empty(layout.padded_numel)
                dist.all_gather_into_tensor(gathered, flat.contiguous(), group=unit._process_group)
                flat = gathered
            for name, offset, numel, shape in zip(entry.names, layout.offsets, layout.numels, layout.shapes):
                per_param[name][key] = flat[offset : offset + numel].view(shape).clone()
        else:
            for name in entry.names:
                per_param[name][key] = value.clone() if isinstance(value, torch.Tensor) else value
    return per_param


def _flatten_state(entry: _OptimEntry, saved: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Full per-parameter optimizer state (in the unit's flat order) as this rank's flat-shard state."""
    handle = entry.unit._handle
    layout = handle.layout
    out: dict[str, Any] = {}
    if all(len(shape) == 0 for shape in layout.shapes):
        raise NotImplementedError(
            f"FullyShardedDataParallel.optim_state_dict_to_load: unit '{entry.unit._unit_name or '<root>'}' "
            f"holds only 0-dim parameters, whose per-element state cannot be told from a scalar such "
            f"as 'step'; wrap them together with other parameters."
        )
    for key in saved[0]:
        first = saved[0][key]
        shaped = [isinstance(s.get(key), torch.Tensor) and tuple(s[key].shape) == tuple(shape)
                  for s, shape in zip(saved, layout.shapes)]
        any_dims = any(isinstance(s.get(key), torch.Tensor) and s[key].dim() > 0 for s in saved)
        if any_dims and all(shaped):
            flat = torch.cat([s[key].detach().reshape(-1).to(device) for s in saved])
            flat = torch.cat([flat, flat.new_zeros(layout.padded_numel - flat.numel())])
            begin, end = layout.shard_range(handle.rank)
            out[key] = flat[begin:end].clone()
        elif any_dims:
            bad = [n for n, ok in zip(entry.names, shaped) if not ok][0]
            raise ValueError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: state '{key}' of '{bad}' does not have "
                f"the parameter's shape; expected a state dict from FSDP.optim_state_dict()."
            )
        else:  # a scalar such as Adam's step: the optimizer's load_state_dict places it
            out[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return out


def _has_meta(unit_modules: list[tuple[str, nn.Module]]) -> bool:
    return any(
        t.is_meta for _, m in unit_modules for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    )


def _check_not_owned(p: torch.Tensor, fqn: str) -> None:
    """Raises if another unit already owns ``p``: tied parameters must live in one unit."""
    owner = getattr(p, _OWNER_ATTR, None)
    if owner is None:
        return
    owner_unit, owner_fqn = owner
    raise ValueError(
        f"FullyShardedDataParallel: parameter '{fqn}' is the same tensor as "
        f"'{owner_fqn}', which unit '{owner_unit or '<root>'}' already owns: tied "
        f"parameters must live in one unit. Put modules '{fqn.rpartition('.')[0] or '<root>'}' "
        f"and '{owner_fqn.rpartition('.')[0] or '<root>'}' into one unit, e.g. do not "
        f"wrap either on its own, so that their common parent owns the parameter."
    )


def _materialize_with(
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
                _check_not_owned(p, _join(unit_name, _join(prefix, attr)))
                slots.append((m, attr, p))
    # Breadth-first, root first, as torch calls it (a re-tie in param_init_fn may rely on that).
    for _, m in sorted(unit_modules, key=lambda pm: pm[0].count(".") + 1 if pm[0] else 0):
        param_init_fn(m)
    for prefix, m in unit_modules:
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and t.is_meta:
                name = _join(unit_name, _join(prefix, attr))
                raise ValueError(
                    f"FullyShardedDataParallel: '{name}' is still on the meta device after param_init_fn "
                    f"ran on module '{_join(unit_name, prefix) or type(m).__name__}'. param_init_fn must "
                    f"materialize the module's own parameters and buffers, e.g. "
                    f"module.to_empty(device=..., recurse=False) followed by their initialization."
                )
    originals: dict[int, nn.Parameter] = {}
    for m, attr, old in slots:
        new = m._parameters.get(attr)
        if new is not None and new is not old:
            originals.setdefault(id(new), old)
    return originals


_SYNC_BUCKET_BYTES = 250 * 1024 * 1024  # as torch's FSDP1


def _broadcast_from_first_rank(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
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
                dist.broadcast(bucket[0], src=src, group=group)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _check_uniform(params: list[nn.Parameter], names: list[str], unit_name: str) -> None:
    unit = f"'{unit_name}'" if unit_name else "<root>"
    first = params[0]
    for attr, fix in (
        ("dtype", "Cast the module to one dtype (e.g. module.float()) or wrap those modules in separate units"),
        ("device", "Move the module to one device (or pass device_id=) or wrap those modules in separate units"),
        ("requires_grad", "Freeze or unfreeze whole units, or wrap the frozen modules in separate units"),
    ):
        for p, n in zip(params, names):
            if getattr(p, attr) != getattr(first, attr):
                raise ValueError(
                    f"FullyShardedDataParallel: unit {unit}: parameters of one unit must share one "
                    f"{attr}, but '{names[0]}' has {attr}={getattr(first, attr)} and '{n}' has "
                    f"{attr}={getattr(p, attr)}. {fix}."
                )


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from _tensors_in(getattr(obj, f))


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
