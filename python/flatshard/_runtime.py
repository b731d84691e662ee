"""The per-step lifecycle of a unit: lazy init, forward, the views autograd tracks; its backward (pre-backward,
post-backward, the root's end of backward) is in _backward.py.

Each function takes the unit (a ``FullyShardedDataParallel``, or a module fully_shard made) it acts on; either
front-end's forward and ``no_sync`` call in here, and the autograd hooks and the ``_UnshardedViews`` node registered
here call into _backward.py. The collective work itself is one call into the C++ scheduler per step of the
lifecycle.

[Note: Unit lifecycle]
forward (per call of a unit):
  unshard -> wait (+ forward prefetch: the unit that came next in the last
  training iteration, with the small units after it, see [Note: Forward prefetch]
  and [Note: Gathering small units together] in _prefetch.py) -> hand the original parameters out
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
backpropagates through the rerun) it is a post-backward like any other (see
[Note: Pending uses] for when it holds the unit's reduction back). Around a unit (``checkpoint(unit, x)``): the
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
use counts as pending. A rerun's speculative use counts when the backward
being run executes its node: a unit the rerun calls twice (reentrant
checkpointing of ``unit(unit(x))``) keeps its parameters until both uses'
backward ran.

[Note: no_sync]
Inside ``no_sync()`` gradients are not reduced: each unit's gradient accumulates
unsharded (its full size, in ``param_dtype``) until the first backward outside the
context reduces it once. Parameters reshard and are gathered again as outside the
context (after forward for FULL_SHARD, after each unit's backward), so the memory
held across the accumulation is the unsharded gradients only: torch FSDP1's.
``no_sync(keep_parameters_unsharded=True)`` is the collective-free mode: units stay
unsharded from their first forward in the context until the first backward outside
it, so no all-gather runs during the accumulation either, at the cost of every
unit's unsharded parameters as well (as DDP holds them).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from flatshard import (_C, _backward, _dtensor_params, _exit, _mixed_precision, _orig_params, _prefetch, _rank_guard,
                       _stall_watch, _tensor_parallel)
from flatshard._common import UsageError, clean_name, is_unit, tensors_in, to_device
from flatshard._construction import all_gather_limit, unit_modules
from flatshard._mixed_precision import cast_floating
from flatshard._state import RootState, TrainingState, UnitState

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel

FORWARD, SUMMONING = TrainingState.FORWARD, TrainingState.SUMMONING


# ----------------------------------------------------------------- lazy init


def _post_forward_group_index(root: RootState, s: UnitState) -> int:
    """The scheduler's group pair of the unit's post-forward group (see [Note: Reshard to a smaller group] in
    csrc/flatshard/flat_param.h), added on first use; -1 without one."""
    group = s.config.post_forward_group
    return -1 if group is None else _group_pair(root, group, None, None)


def _group_pair(root: RootState, shard: Any, replicate: Any, scatter: Any) -> int:
    """The index of the scheduler's pair of these groups (see [Note: Groups per unit] in csrc/flatshard/scheduler.h),
    added on first use; ``scatter``: fully_shard's separate reduce-scatter group, or None."""
    key = (id(shard), id(replicate), id(scatter))
    if key not in root.group_pairs:
        index = root.group_pairs[key] = root.scheduler.add_groups(shard, replicate)
        if scatter is not None:
            root.scheduler.set_reduce_scatter_group(index, scatter)
    return root.group_pairs[key]


def assign_groups(root: RootState, s: UnitState) -> None:
    """The unit's collectives onto its groups' pair (at lazy init; again after set_separate_reduce_scatter_group)."""
    if s.handle is not None:
        s.handle.group_index = _group_pair(root, s.config.process_group, s.config.replicate_group,
                                           s.reduce_scatter_group)
        s.handle.post_forward_group_index = _post_forward_group_index(root, s)


def set_reductions_in_flight(root: RootState) -> None:
    """The scheduler keeps the most reduce-scatters in flight that any of its units asks for (fully_shard's
    set_reduce_scatter_max_input_buffers; torch's FSDP2 also takes the largest of its groups')."""
    root.scheduler.max_reductions_in_flight = max(u._unit_state.reduce_scatters_in_flight for u in root.units)


@torch._disable_dynamo  # (a root compiled before its first forward: built as it is, see [Note: Lazy dynamo])
def lazy_init(root: FullyShardedDataParallel) -> None:
    """Makes ``root`` the root of every unit below it: one RootState, one scheduler (see [Note: Unit state]).

    A unit that another root initialized as one of its own (a model wrapped again, e.g. for
    inference after training, as torch's FSDP1 allows) is taken over, between iterations; a unit
    that ran as a root itself cannot be nested afterwards (as torch's)."""
    top = root._unit_state
    if len(top.members) > 1:  # (torch's FSDP2 phrase and type)
        raise RuntimeError(
            f"FSDP requires a single root module but got {top.members}: one fully_shard of a list of modules "
            f"ran as a root; call fully_shard on a module that contains them too (the model), after the list's.")
    units = _units_under(root)
    scheduler = _C.Scheduler(top.config.process_group, top.config.replicate_group, top.device,
                             all_gather_limit(top.config.limit_all_gathers))
    root_state = RootState(root, scheduler, [u for _, u in units])
    # Units over other groups (e.g. experts over an expert group): one pair each; see
    # [Note: Groups per unit] in csrc/flatshard/scheduler.h.
    root_state.group_pairs[(id(top.config.process_group), id(top.config.replicate_group), id(None))] = 0
    for _, unit in units:
        assign_groups(root_state, unit._unit_state)
    set_reductions_in_flight(root_state)
    scheduler.coalesce_bytes = root_state.gather_together_bytes  # see [Note: Small units gathered together]
    for _, unit in units:
        previous = unit._unit_state.root
        if previous is not None and previous.unit is not root:
            previous.taken_over = True  # its root rebuilds itself at its next forward
    for name, unit in units:
        s = unit._unit_state
        s.root = root_state
        s.is_root = unit is root
        s.name = name
        if s.handle is not None:
            s.handle.name = name
        s.forward_input_dtype = _mixed_precision.forward_input_dtype(s.config.mixed_precision, s.is_root)
        if s.handle is not None and s.config.dim0_layout:  # parameters replaced on the modules since fully_shard
            _dtensor_params.rebind(s)  # (transformers' weight loading): adopted, as torch's FSDP2 does
        # (fully_shard's unit is its module itself: not an inner unit of its own)
        owned = unit_modules(s.wrapped_module, s.config.ignored_modules, lambda m, u=unit: is_unit(m) and m is not u)
        _mixed_precision.cast_buffers(s, list(owned))
    _exit.register_for_exit(root_state)  # see [Note: Exit] in _exit.py
    guard_mode = _rank_guard.mode(top.config.process_group)
    if guard_mode != "off":  # see [Note: Rank-divergence guard]
        root_state.guard = _rank_guard.create(root_state)
        scheduler.set_sequence_check(guard_mode == "strict")


def _units_under(root: FullyShardedDataParallel) -> list[tuple[str, FullyShardedDataParallel]]:
    """Every unit under ``root`` (itself first) with its name, checked: none ran as a root of its own or is in
    another root's backward, and all share the root's device and all-gather limit (one runtime)."""
    units = []
    seen_states = set()  # a list given to fully_shard is one unit of several modules: walked once
    for name, m in root.named_modules():
        if is_unit(m) and id(m._unit_state) not in seen_states:
            seen_states.add(id(m._unit_state))
            s = m._unit_state
            if m is not root and s.is_root:
                raise RuntimeError(
                    f"Non-root FSDP instance's `_is_root` should not have been set yet or should have been set to "
                    f"`False`: unit '{clean_name(name)}' ran as a root (its forward was called) before this outer "
                    f"FSDP module wrapped it; call only the outermost FSDP module's forward."
                )
            if s.root is not None and s.root is not root._unit_state.root and s.root.final_callback_queued:
                raise RuntimeError(
                    f"FullyShardedDataParallel: unit '{clean_name(name)}' is in a backward of another root; wrap "
                    f"it again between iterations."
                )
            units.append((clean_name(name), m))
    top = root._unit_state
    for name, unit in units:
        s = unit._unit_state
        if s.config.dim0_layout != top.config.dim0_layout:
            raise ValueError(
                f"flatshard: unit '{name}' was made by {'fully_shard' if s.config.dim0_layout else 'FullyShardedDataParallel'}"
                f" and its root by {'fully_shard' if top.config.dim0_layout else 'FullyShardedDataParallel'}; one "
                f"model uses one of the two APIs.")
        for what, mine, roots in (("device_id", s.device, top.device),
                                  ("limit_all_gathers", s.config.limit_all_gathers, top.config.limit_all_gathers)):
            if mine != roots:
                raise ValueError(
                    f"FullyShardedDataParallel: unit '{name}' has {what}={mine} but its root "
                    f"has {roots}; the units of one root share one runtime. Wrap them "
                    f"with the same {what}."
                )
    return units


class Use:
    """One use of a unit's parameters by autograd.

    Made by a grad-enabled forward call (its place in the post-forward order
    is recorded for backward prefetch), or speculatively when views are handed
    out again during backward (see [Note: Recomputation]). ``node`` is a weak
    reference to its ``_UnshardedViews`` node. See [Note: Pending uses].
    """

    __slots__ = ("node", "order", "index", "done", "speculative", "__weakref__")

    def __init__(self, state: UnitState, speculative: bool = False) -> None:
        self.node: Callable[[], Any] | None = None
        self.order: list = []
        self.index = -1
        self.done = False
        self.speculative = speculative
        state.uses.add(self)

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
    def forward(ctx, state: UnitState, use: Use, flat_param: nn.Parameter, views: list[torch.Tensor]):
        # ``views``: made by the scheduler's wait_for_unshard (a list, so not an input of this node).
        ctx.state = state
        ctx.use = use
        use.node = weakref.ref(ctx)  # ctx is the node: it dies with the graph
        views = tuple(views)
        if state.frozen_indices:  # use_orig_params: frozen parameters in a trainable unit get no gradient
            ctx.mark_non_differentiable(*(views[i] for i in state.frozen_indices))
        # A parameter this use did not touch: FSDP2 leaves its .grad None, FSDP1 gives it zeros (its flat
        # parameter's gradient covers every parameter), which autograd's materialized zeros are.
        ctx.set_materialize_grads(not state.config.dim0_layout)
        return views

    @staticmethod
    def backward(ctx, *grads):
        _backward.post_backward(ctx.state, ctx.use, grads)
        return None, None, None, None


# [Note: Applying the views' node]
# ``torch.autograd.Function.apply`` is a Python classmethod that, outside functorch's transforms (vmap, grad, ...),
# unwraps dead functorch wrappers from the arguments and calls ``_FunctionBase.apply``, the C++ one; that Python
# layer is 40% of the node's cost (4 of 10 us here, once a unit a forward). Our arguments are the unit's own state,
# flat parameter and views, never functorch wrappers, so outside the transforms the C++ apply is called straight;
# under a transform, the whole of ``Function.apply`` (which refuses the node there: it has no setup_context).
_C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _UnshardedViews)


def _apply_views(s: UnitState, use: Use, views: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``views`` as the outputs of the use's ``_UnshardedViews`` node (see [Note: Applying the views' node])."""
    if torch._C._are_functorch_transforms_active():
        return _UnshardedViews.apply(s, use, s.flat_param, views)
    return _C_APPLY(s, use, s.flat_param, views)


def set_views(state: UnitState, views, placeholders: bool = False, parameters: bool = False) -> None:
    """Puts ``views`` (one per original parameter) on the modules as their parameter attributes;
    with ``use_orig_params`` the placeholders are the registered parameters themselves (see
    [Note: Original parameters] in _orig_params.py): the views that shadowed them go. With
    ``config.registers_unsharded`` (fully_shard) the views are the registered parameters meanwhile;
    ``parameters`` (fully_shard's ``unshard()``): as ``nn.Parameter``s that require grad as the sharded ones do,
    until a forward or backward puts its own views there."""
    state.placeholders_set = placeholders
    state.explicit_unshard = parameters
    state.forward_use = None
    if state.config.registers_unsharded:  # see [Note: fully_shard's parameters are registered, not shadowed]
        if placeholders:
            views = state.orig_params
        elif state.tp_params:  # (see [Note: Tensor-parallel parameters] in _tensor_parallel.py)
            views = _tensor_parallel.as_tp_dtensors(state, views)
        if parameters:
            views = [nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(views, state.orig_params)]
        for m, attr, index in state.param_slots:
            m._parameters[attr] = views[index]
        return
    if placeholders and state.config.use_orig_params:
        for m, attr, _ in state.param_slots:
            m.__dict__.pop(attr, None)
        return
    # Straight into __dict__: nn.Module.__setattr__ costs microseconds, three times a unit a step.
    for m, attr, index in state.param_slots:
        m.__dict__[attr] = views[index]


# [Note: fully_shard's parameters are registered, not shadowed]
# The class, as torch's FSDP1, puts each unsharded view in the module's __dict__, where it shadows what is registered.
# fully_shard, as torch's FSDP2, registers it in ``_parameters`` instead, and nothing else: code that swaps a module's
# ``_parameters`` entries around a forward then sees its own tensors used (transformers' tensor parallelism runs
# a no-grad forward of a TP layer on local tensors so, ``_use_local_dtensor_params``), where a view in __dict__ would
# still be read. The attribute read then goes through nn.Module.__getattr__, a fraction of a microsecond.


def after_shard_cast(state: UnitState) -> None:
    """The unit's shard changed dtype between iterations (``model.half()``, or its ``.data`` replaced):
    the runtime's buffers, views and the guard's description follow it."""
    if state.config.use_orig_params:  # (a zero_grad since the last step must not come back with the views below)
        _orig_params.write_back_grads(state)
    state.handle.after_shard_cast()
    state.storage_changed()
    if state.root is not None and state.root.guard is not None:
        state.root.guard.model_changed()
    if state.config.use_orig_params:
        _orig_params.use_sharded_views(state)
        _orig_params.use_grad_views(state)
    else:
        set_views(state, state.placeholders, placeholders=True)


def reshard(state: UnitState, after_forward: bool = False) -> None:
    """Frees the unsharded buffer (a prefetched one too); the modules get storage-less placeholders back
    (which also lets go of the last forward's views and their graph) unless they hold them already. After
    forward, a unit given a post-forward group keeps its part for it (see [Note: Reshard to a smaller group]
    in csrc/flatshard/flat_param.h)."""
    root = state.root
    root.scheduler.reshard(state.handle, after_forward)
    if root.gathered_ahead:
        root.gathered_ahead.discard(state)
    if not state.placeholders_set:
        set_views(state, state.placeholders, placeholders=True)


# ------------------------------------------------------------------- forward


class ForwardCall:
    """What a unit's pre-forward hands its post-forward: the kind of call ("forward", "recompute" or
    "summoned": inside summon_full_params, run as it is), its use, whether grad was enabled, its inputs."""

    __slots__ = ("kind", "use", "grad_enabled", "inputs")

    def __init__(self, kind: str, use: Use | None = None, grad_enabled: bool = False, inputs: Any = None) -> None:
        self.kind = kind
        self.use = use
        self.grad_enabled = grad_enabled
        self.inputs = inputs


_SUMMONED = ForwardCall("summoned")


def forward(unit: FullyShardedDataParallel, args: tuple, kwargs: dict) -> Any:
    """One call of a unit that wraps its module (the class): see [Note: Unit lifecycle]."""
    args, kwargs, call = begin_forward(unit, args, kwargs)
    try:
        output = unit._unit_state.wrapped_module(*args, **kwargs)
    except BaseException:
        end_forward(unit, call, None, raised=True)
        raise
    return end_forward(unit, call, output)


def begin_forward(unit: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, ForwardCall]:
    """A unit's pre-forward, for either front-end (the class's forward; fully_shard's forward pre-hook): the
    inputs the module is to run on, and what ``end_forward`` needs. See [Note: Unit lifecycle]."""
    s = unit._unit_state
    if s.is_root is None:
        lazy_init(unit)
    if s.training_state is SUMMONING:
        # Inside summon_full_params (e.g. generate() in an evaluation or RL loop): the module
        # holds its full parameters, in full precision; run it as it is.
        if s.is_root and s.device.type != "cpu":
            args, kwargs = to_device((args, kwargs), s.device)
        return args, kwargs, _SUMMONED
    if torch._C._current_graph_task_id() != -1:  # in a backward (common.in_backward, one call less per unit)
        return _begin_recompute(s, args, kwargs)
    if s.training_state is FORWARD:  # (before the root's work: its guard check is a collective)
        raise UsageError(
            f"FullyShardedDataParallel: unit '{s.label}' was called inside its own forward; a unit's module may "
            f"call it only after its forward returns (call the inner module, or wrap it in a unit of its own).")
    if s.is_root:
        _root_pre_forward(unit)
    # (A fully_shard unit called on its own, outside its root's forward, as torch's FSDP2 allows: what the user did to
    # the gradients is written back when its backward starts, as for any backward.)
    if s.is_root or s.forward_input_dtype is not None:
        args, kwargs = _forward_inputs(s, args, kwargs)
    grad_enabled = torch.is_grad_enabled()
    use = _pre_forward(s, grad_enabled)
    s.switch("forward")
    if s.is_root:
        s.root.in_forward_call = True  # (see summon_full_params)
        s.root.forward_serial += 1
    return args, kwargs, ForwardCall("forward", use, grad_enabled, (args, kwargs))


def end_forward(unit: Any, call: ForwardCall, output: Any, raised: bool = False) -> Any:
    """A unit's post-forward, for either front-end: the output, its backward hooked; with ``raised`` (the
    module raised: the caller re-raises) only the unit's state is put back."""
    kind = call.kind
    if kind == "forward":
        s = unit._unit_state
        if s.is_root:
            s.root.in_forward_call = False
            if s.root.prefetched_ahead is not None or s.root.gathered_ahead:  # (their forward never came: see
                _prefetch.drop_unused(s.root)  # [Note: Forward prefetch] in _prefetch.py)
        s.switch("end of forward")
        return output if raised else _post_forward(s, call.use, call.grad_enabled, call.inputs, output)
    if kind == "recompute":
        return _end_recompute(unit._unit_state, output, raised)
    return output


def _root_pre_forward(unit: FullyShardedDataParallel) -> None:
    """What the root does before its forward, and no other unit: takes its units back from another root,
    refuses shards on the host, the guard's check, drops a backward that raised, starts the iteration."""
    s = unit._unit_state
    root = s.root
    if root.taken_over:  # another root took some of its units over since: take them back
        if root.final_callback_queued:
            _backward.abort_backward(root)
        s.drop_root()
        lazy_init(unit)
        root = s.root
    if root.shards_on_host:  # see [Note: Shards on the host] in _host_offload.py
        raise RuntimeError(
            f"FullyShardedDataParallel: the shards of '{s.label}' are in host memory "
            f"(flatshard.move_shards_to_host, or torch's handle.flat_param_to): call "
            f"flatshard.move_shards_to_device(model) before the next forward.")
    if root.guard is not None:  # see [Note: Rank-divergence guard]
        _guard_forward(root)
    if root.final_callback_queued:
        _backward.abort_backward(root)
    if root.in_iteration and (root.first_use is None or root.first_use() is None):
        # The iteration's first forward is gone with no backward through it (a forward with grad whose output was
        # dropped: an evaluation without no_grad, a loss skipped as NaN), or it used no trainable unit (a frozen
        # teacher's): a new iteration, else the forward orders would grow with every such forward. (A backward
        # through two forwards keeps the first one's graph; through a frozen model's two forwards, only the backward
        # prefetch across them is lost.)
        root.in_iteration = False
    if not root.in_iteration:
        root.in_iteration = True
        root.first_use = None
        if root.iteration_trains:  # see [Note: Forward prefetch]
            root.forward_prefetch_order = root.pre_forward_order
        root.iteration_trains = torch.is_grad_enabled()
        root.pre_forward_order = []
        root.post_forward_order = []
        for u in root.orig_param_units:  # what the user changed since the last iteration
            _orig_params.write_back_before_forward(u._unit_state)


def _forward_inputs(s: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs of a unit's forward (and of its recomputation): the root's moved to its device, and cast to
    the forward's input dtype (see flatshard/_mixed_precision.py)."""
    if s.is_root and s.device.type != "cpu":
        args, kwargs = to_device((args, kwargs), s.device)
    if s.forward_input_dtype is not None:
        args, kwargs = cast_floating(s.forward_input_dtype, (args, kwargs))
    return args, kwargs


def _pre_forward(s: UnitState, grad_enabled: bool) -> Use | None:
    """The unit's parameters unsharded and on its modules, as views autograd tracks through a new use if its
    gradients will be computed (that use, else None)."""
    root = s.root
    handle = s.handle
    if handle is None:
        return None  # see [Note: The orders hold units that gather] in _prefetch.py
    position = len(root.pre_forward_order)
    root.pre_forward_order.append(s)
    if root.gathered_ahead:
        root.gathered_ahead.discard(s)
    if root.prefetched_ahead is not None and root.prefetched_ahead is not s:
        _prefetch.drop_unused(root)
    root.prefetched_ahead = None
    # Waiting first lets the backend drop its temporaries for this all-gather before the next one is issued (on
    # devices with events the wait only orders streams: no overlap is lost).
    # One crossing: see [Note: One crossing per lifecycle step] in bindings.cpp (two where a group is gathered).
    explicit = s.forward_prefetch_to
    ahead, group = (_prefetch.forward(root, s, position) if s.config.forward_prefetch and explicit is None
                    else (None, None))
    held = _held_forward_use(s) if grad_enabled else None
    views = root.scheduler.wait_for_unshard(handle, ahead, views=held is None)
    if group:
        _prefetch.unshard_group(root, group)
    if explicit:
        _prefetch.explicit(root, explicit)
    if held is not None:
        return held
    flat = s.flat_param
    if not (grad_enabled and flat.requires_grad):
        set_views(s, views)
        return None
    use = Use(s)
    if root.first_use is None:
        root.first_use = weakref.ref(use)
    set_views(s, _apply_views(s, use, views))
    if s.config.registers_unsharded and root.in_forward_call:
        s.forward_use = (weakref.ref(use), root.forward_serial)
    return use


# [Note: One set of unsharded parameters per gathering]
# torch's FSDP2 gives a unit one set of unsharded nn.Parameters (made at its first all-gather, refilled by later ones):
# a unit called again before it reshards (a list of modules' next member with reshard_after_forward=False, a module
# called twice in one forward) runs on the same parameters, so that `model.parameters()` after the forward are those
# every call used (`torch.autograd.grad(loss, model.parameters())` covers every call), and their gradients from every
# call add up before its one post-backward. fully_shard's views are made per gathering, so it does the same within one:
# a grad-enabled forward within the same forward of the root, while the modules still hold an earlier call's views of
# this gathering (``forward_use``: cleared whenever other views are put there, which a reshard does), takes that use
# and its views (keeping its first call's place in the post-forward order), and the use's post-backward runs once
# every call's gradients are in. Another forward of the root is another use (forwards whose output is dropped must not
# keep one use, and the iteration, alive). Not torch's: the views are outputs of one autograd node per unit, not
# leaves, so what takes a parameter for a leaf (torch.distributed.pipelining's split backward, stage_backward_weight,
# which differentiates with respect to each parameter's GradientEdge(grad_fn, 0)) gets the node's first output for
# each. The class makes new views each forward, as torch's FSDP1 does.
def _held_forward_use(s: UnitState) -> Use | None:
    if s.forward_use is None:
        return None
    held, serial = s.forward_use
    use = held()
    if use is None or use.done or use.node is None or use.node() is None or serial != s.root.forward_serial or \
            not s.root.in_forward_call:  # (within one forward of the root only: another forward is another use)
        s.forward_use = None
        return None
    return use


def frees_after_forward(s: UnitState) -> bool:
    """Whether a unit's forward (or its rerun in the whole model's recomputation) ends by resharding: its
    strategy reshards after forward, no_sync(keep_parameters_unsharded=True) does not hold it, and there is
    something to free (a replicated unit keeps its views for backward)."""
    return s.handle is not None and s.config.reshard_after_forward and not s.holds_unsharded and not s.replicated


def reshards_after_forward(s: UnitState) -> bool:
    """Whether a forward of the unit ends by freeing its parameters (the root keeps them for the backward that
    starts there, unless its front-end says otherwise); also what a registered forward method ends with (see
    [Note: Forward methods] in _fsdp_module.py)."""
    return frees_after_forward(s) and (not s.is_root or s.config.root_reshards_after_forward)


def _post_forward(s: UnitState, use: Use | None, grad_enabled: bool, inputs: Any, output: Any) -> Any:
    """After a unit's forward: a frozen unit's end of backward hooked, the unit resharded (as its strategy says;
    the root keeps its parameters for the backward that starts there; without grad the class's always),
    without grad the iteration ended at the root, else the use's pre-backward hooked to the output."""
    root = s.root
    if s.handle is not None and grad_enabled and not s.flat_param.requires_grad:
        # A frozen unit has no post-backward: its backward is over once its inputs' gradients are computed. (Leaf
        # inputs left out: torch's multi-grad hook refuses them inside torch.autograd.grad; a unit whose inputs are
        # all leaves is resharded at the end of backward.)
        tensors = [t for t in tensors_in(inputs) if t.requires_grad and t.grad_fn is not None]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(_backward.frozen_post_backward, s),
                                                          mode="all")
    # Without grad no backward follows: the class reshards every unit there (torch FSDP1's), fully_shard only as
    # after any forward (torch FSDP2's: a root given None keeps its parameters, for generate's next step).
    no_grad_reshards = not grad_enabled and s.config.reshard_after_no_grad_forward
    if s.handle is not None and (no_grad_reshards or reshards_after_forward(s)):
        reshard(s, after_forward=True)
    if not grad_enabled:
        if s.is_root:
            # The iteration ends here; with the class, with nothing unsharded (forward-prefetched units included).
            root.in_iteration = False
            for u in root.units if no_grad_reshards else ():
                us = u._unit_state
                if us.handle is not None and not us.holds_unsharded:
                    reshard(us)
        return output
    order = root.post_forward_order
    index = len(order)
    if s.handle is not None:  # see [Note: The orders hold units that gather] in _prefetch.py
        order.append(s)
    if use is not None and use.index < 0:  # (a use taken again keeps its first call's place: see [Note: One set of
        use.order, use.index = order, index  # unsharded parameters per gathering])
    # The hook keeps the order and the index, not the use: only the views' node may keep a use alive (a node
    # that cannot run is no pending use).
    _hook_outputs(output, functools.partial(_backward.pre_backward, s, order, index))
    return output


def forward_raised(unit: FullyShardedDataParallel, error: BaseException) -> None:
    """A root's forward raised: its peers may be left waiting in this forward's collectives (see [Note: Stalled
    waits]); where it left is noted for them."""
    s = unit._unit_state
    if s.is_root and s.root is not None and s.root.guard is not None:
        _stall_watch.note_abandoned(s.root.guard.label, s.root.guard.forwards, error)


def _hook_outputs(output: Any, hook: Callable) -> None:
    """``hook`` runs at the first gradient w.r.t. any tensor of ``output``: the use's pre-backward."""
    if type(output) is torch.Tensor:  # the common case, without walking a structure
        if output.requires_grad:
            _hook_tensor(output, hook)
        return
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if len(tensors) == 1:  # the common case, and much cheaper than a multi-grad hook
        _hook_tensor(tensors[0], hook)
    elif tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")


# [Note: The pre-backward hook on the output's node]
# One output's pre-backward runs before the node that made it: a pre-hook on that node (``grad_fn.register_prehook``)
# rather than a hook on the tensor (``register_hook``), which costs 3 us more a unit a step (its handle and hook dict,
# and the engine's tensor pre-hook wrapper). Where the two differ, the node's runs no later: it also runs when only a
# sibling output of a node with several gets a gradient, which is the unit's backward starting too. Dynamo traces
# tensor hooks, not node pre-hooks: a compiled forward registers the tensor's; a leaf output (no node) too.
def _hook_tensor(tensor: torch.Tensor, hook: Callable) -> None:
    node = tensor.grad_fn
    if node is None or torch.compiler.is_compiling():
        tensor.register_hook(hook)
    else:
        node.register_prehook(hook)


# [Note: Lazy dynamo]
# The few functions a compiled forward must call as they are (lazy init itself, where a root is compiled before its
# first forward; the guard's check, its creation at lazy init, the forward's guard call: process groups and C++
# handles are not traceable) are marked with
# torch._disable_dynamo, not torch.compiler.disable: the same mark, applied at the first call, so that
# `import flatshard` does not import torch._dynamo (seconds of a process's start, for every rank and tool
# that never compiles). torch marks its own functions so (torch.manual_seed, the optimizers' hooks); dynamo
# knows the wrapper (trace_rules). tests/test_imports.py checks the import, tests/test_compile.py the graphs.
@torch._disable_dynamo  # (a compiled forward calls it as it is: the C++ handles are not traceable; [Note: Lazy dynamo])
def _guard_forward(root: RootState) -> None:
    """The guard's check before a forward that will all-gather something: it checks, and counts, only those
    (see [Note: Rank-divergence guard])."""
    if root.scheduler.count_sharded(root.sharded_handles):
        root.guard.check(root, "forward")
        root.guard.counted_forward()


def _begin_recompute(s: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict, ForwardCall]:
    """forward() during backward: activation checkpointing reruns this unit (see [Note: Recomputation]).
    The unit is in backward, before its gradients: PRE_BACKWARD."""
    root = s.root
    if s.training_state is SUMMONING or s.training_state is FORWARD:
        _backward._refuse_backward(s)
    s.switch("recompute")
    # Checkpointing around the root: its first forward ran without grad (and ended the
    # iteration), so no pre-backward queued the end of this backward. (Not a backward inside
    # the forward: see [Note: A backward inside the forward] in _backward.py.)
    if not root.in_forward_call:
        _backward.queue_end_of_backward(root)
    args, kwargs = _forward_inputs(s, args, kwargs)  # as in its first forward
    handle = s.handle
    if handle is not None:
        hand_out_views(s, root.scheduler.wait_for_unshard(handle, None, views=True))
    if s.is_root:  # the whole model reruns at once
        root.recompute_order = []
        root.recomputing = True
    return args, kwargs, ForwardCall("recompute")


def _end_recompute(s: UnitState, output: Any, raised: bool) -> Any:
    root = s.root
    if s.is_root:
        root.recomputing = False
        return output
    if not raised and root.recomputing and frees_after_forward(s):
        # Rerunning the whole model must not hold every unit unsharded at once: reshard as
        # the first forward did. Before any of this unit's backward runs, its pre-backward
        # gathers it again, through the hook of its first forward (non-reentrant
        # checkpointing backpropagates the first graph) or this one (reentrant: this graph).
        order = root.recompute_order
        index = len(order)
        order.append(s)
        _hook_outputs(output, functools.partial(_backward.pre_backward, s, order, index))
        reshard(s, after_forward=True)
    return output


def hand_out_views(s: UnitState, views: list[torch.Tensor]) -> None:
    """Fresh ``views`` of the unsharded buffer, as autograd views through a speculative use (see
    [Note: Recomputation])."""
    if not s.flat_param.requires_grad:
        set_views(s, views)
        return
    use = Use(s, speculative=True)
    with torch.enable_grad():
        set_views(s, _apply_views(s, use, views))


def live_uses(s: UnitState) -> list[Use]:
    """The unit's uses still alive: a snapshot of ``s.uses`` through its set of weak references (iterating the
    WeakSet itself costs microseconds a call, and this runs in every post-backward). ``list``, not ``tuple``: tuple()
    allocates its result after making the set's iterator, and on Python < 3.12 that allocation may collect garbage,
    which may remove a dead use from the set under the iterator; list() grows without a collectable allocation."""
    return [use for ref in list(s.uses.data) if (use := ref()) is not None]


def has_pending_uses(s: UnitState) -> bool:
    """Whether a use of this unit still runs its post-backward in this backward (see [Note: Pending uses])."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        return False
    nested = task != s.root.backward_task
    for use in live_uses(s):
        if use.done or use.node is None:
            continue
        node = use.node()
        if node is None:
            continue
        if use.speculative:  # a rerun's use: pending when this backward runs it (reentrant checkpointing)
            if torch._C._will_engine_execute_node(node):
                return True
        elif nested or torch._C._will_engine_execute_node(node):
            return True
    return False


def require_root(unit: FullyShardedDataParallel, torch_phrase: str) -> RootState:
    """The root state of ``unit`` (lazily initialized), which must be the root: else a RuntimeError that
    starts with ``torch_phrase``, torch's message for the call, and names the unit."""
    top = unit._unit_state
    if top.is_root is None:
        lazy_init(unit)
    if not top.is_root:
        raise RuntimeError(f"{torch_phrase} (unit '{top.name}' is nested; call it on the outermost FSDP module).")
    return top.root


@contextlib.contextmanager
def no_sync(root: FullyShardedDataParallel, keep_parameters_unsharded: bool = False) -> Iterator[None]:
    """See ``FullyShardedDataParallel.no_sync`` and [Note: no_sync]."""
    states = [u._unit_state for u in require_root(root, "`no_sync()` on inner FSDP instances is not supported. "
                                                        "Please call `no_sync()` on root FSDP module").units]
    previous = [(s, s.sync_gradients, s.holds_unsharded) for s in states]
    for s in states:
        s.sync_gradients = False
        s.holds_unsharded = s.holds_unsharded or bool(keep_parameters_unsharded)
    try:
        yield
    finally:
        for s, synced, held in previous:
            s.sync_gradients, s.holds_unsharded = synced, held
