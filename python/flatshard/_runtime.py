"""The per-step lifecycle of a unit: forward, pre-backward, post-backward, the root's end of backward.

Each function takes the unit (a ``FullyShardedDataParallel``) it acts on; the
class's ``forward`` and ``no_sync`` call in here, and the autograd hooks and the
``_UnshardedViews`` node registered here call back into here. The collective
work itself is one call into the C++ scheduler per step of the lifecycle.

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

import atexit
import contextlib
import functools
import time
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from flatshard._common import SHARDED, in_backward, logger, tensors_in, to_device
from flatshard import _comm_hooks, _orig_params
from flatshard._mixed_precision import cast_floating
from flatshard.api import BackwardPrefetch


def init_runtime_state(unit: Any) -> None:
    """The lifecycle's state on a new unit; the root's per-iteration fields are used on the root only."""
    # Live uses of this unit's parameters (see Use and [Note: Pending uses]).
    unit._uses = weakref.WeakSet()
    # Whether the modules hold the storage-less placeholders (see reshard).
    unit._placeholders_set = True
    unit._sync_gradients = True
    # Root only, per iteration (see [Note: Unit lifecycle]).
    unit._final_callback_queued = False
    unit._backward_task = -1  # the graph task of the backward under way
    unit._in_iteration = False
    unit._pre_forward_order = []
    unit._prev_pre_forward_order = []
    unit._post_forward_order = []


class Use:
    """One use of a unit's parameters by autograd.

    Made by a grad-enabled forward call (its place in the post-forward order
    is recorded for backward prefetch), or speculatively when views are handed
    out again during backward (see [Note: Recomputation]). ``node`` is a weak
    reference to its ``_UnshardedViews`` node. See [Note: Pending uses].
    """

    __slots__ = ("node", "order", "index", "done", "speculative", "__weakref__")

    def __init__(self, unit: Any, speculative: bool = False) -> None:
        self.node: Callable[[], Any] | None = None
        self.order: list = []
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
    def forward(ctx, unit: Any, use: Use, flat_param: nn.Parameter):
        ctx.unit = unit
        ctx.use = use
        use.node = weakref.ref(ctx)  # ctx is the node: it dies with the graph
        views = tuple(unit._handle.views())
        frozen = unit.__dict__.get("_frozen_indices")
        if frozen:  # use_orig_params: frozen parameters in a trainable unit get no gradient
            ctx.mark_non_differentiable(*(views[i] for i in frozen))
        return views

    @staticmethod
    def backward(ctx, *grads):
        post_backward(ctx.unit, ctx.use, grads)
        return None, None, None


def set_views(unit: Any, views, placeholders: bool = False) -> None:
    """Puts ``views`` (one per original parameter) on the modules as their parameter attributes;
    with ``use_orig_params`` the placeholders are the registered parameters themselves (see
    [Note: Original parameters] in _orig_params.py): the views that shadowed them go."""
    if placeholders and unit._use_orig_params:
        for m, attr, _ in unit._param_slots:
            m.__dict__.pop(attr, None)
        unit.__dict__["_placeholders_set"] = True
        return
    for m, attr, index in unit._param_slots:
        m.__dict__[attr] = views[index]
    # Straight into __dict__: nn.Module.__setattr__ costs microseconds, three times a unit a step.
    unit.__dict__["_placeholders_set"] = placeholders


def reshard(unit: Any) -> None:
    """Frees the unsharded buffer; the modules get storage-less placeholders back
    (which also lets go of the last forward's views and their graph)."""
    unit._scheduler.reshard(unit._handle)
    set_views(unit, unit._handle.placeholder_views, placeholders=True)


# ------------------------------------------------------------------- forward


def forward(unit: Any, args: tuple, kwargs: dict) -> Any:
    """One call of a unit (see [Note: Unit lifecycle])."""
    if unit._is_root is None:
        unit._lazy_init()
    if unit._in_summon:
        # Inside summon_full_params (e.g. generate() in an evaluation or RL loop): the module
        # holds its full parameters, in full precision; run it as it is.
        if unit._is_root and unit._device.type != "cpu":
            args, kwargs = to_device((args, kwargs), unit._device)
        return unit._fsdp_wrapped_module(*args, **kwargs)
    if in_backward():
        return recompute(unit, args, kwargs)
    root = unit._root
    if unit._is_root:
        guard = root.__dict__.get("_rank_guard")
        if guard is not None:  # see [Note: Rank-divergence guard]
            _guard_forward(root, guard)
        if root._final_callback_queued:
            abort_backward(root)
        if not root._in_iteration:
            root._in_iteration = True
            root._prev_pre_forward_order = root._pre_forward_order
            root._pre_forward_order = []
            root._post_forward_order = []
            for u in root._orig_param_units:  # what the user changed since the last iteration
                _orig_params.writeback(u)
        if unit._device.type != "cpu":
            args, kwargs = to_device((args, kwargs), unit._device)
    if unit._forward_input_dtype is not None:  # see flatshard/_mixed_precision.py
        args, kwargs = cast_floating(unit._forward_input_dtype, (args, kwargs))
    handle = unit._handle
    grad_enabled = torch.is_grad_enabled()
    scheduler = unit._scheduler
    position = len(root._pre_forward_order)
    root._pre_forward_order.append(unit)
    use = None
    if handle is not None:
        # Waiting first lets the backend drop its temporaries for this
        # all-gather before the next one is issued (on devices with
        # events the wait only orders streams: no overlap is lost).
        scheduler.wait_for_unshard(handle)
        if unit._forward_prefetch:
            prefetch(scheduler, root._prev_pre_forward_order, position + 1, backward=False)
        flat = unit._flat_param
        if grad_enabled and flat.requires_grad:
            use = Use(unit)
            set_views(unit, _UnshardedViews.apply(unit, use, flat))
        else:
            set_views(unit, handle.views())

    if unit._is_root:
        unit.__dict__["_in_forward_call"] = True  # (see summon_full_params)
        try:
            output = unit._fsdp_wrapped_module(*args, **kwargs)
        finally:
            unit.__dict__["_in_forward_call"] = False
    else:
        output = unit._fsdp_wrapped_module(*args, **kwargs)

    if handle is not None and grad_enabled and not unit._flat_param.requires_grad:
        # A frozen unit has no post-backward: its backward is over once
        # its inputs' gradients are computed.
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if inputs:
            torch.autograd.graph.register_multi_grad_hook(
                inputs, functools.partial(frozen_post_backward, unit), mode="all"
            )
    if handle is not None and (
        not grad_enabled
        or (
            unit._reshard_after_forward
            and not unit._is_root
            and unit._sync_gradients
            and not handle.is_replicated  # nothing to free: keep the views for backward
        )
    ):
        reshard(unit)
    if not grad_enabled:
        if unit._is_root:
            # No backward follows: end the iteration with nothing unsharded
            # (forward-prefetched units included).
            root._in_iteration = False
            for u in root._units:
                if u._handle is not None and u._sync_gradients:
                    reshard(u)
        return output
    order = root._post_forward_order
    index = len(order)
    order.append(unit)
    if use is not None:
        use.order, use.index = order, index
    # The hook keeps the order and the index, not the use: only the views'
    # node may keep a use alive (a node that cannot run is no pending use).
    hook = functools.partial(pre_backward, unit, order, index)
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if len(tensors) == 1:  # the common case, and much cheaper than a multi-grad hook
        tensors[0].register_hook(hook)
    elif tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
    return output


@torch.compiler.disable  # (a compiled forward calls it as it is: the C++ handles are not traceable)
def _guard_forward(root: Any, guard: Any) -> None:
    """The guard's check before a forward that will all-gather something (it checks, and counts, only
    those: NO_SHARD forwards and those inside no_sync() after the first issue no collective, and
    ranks may run different numbers of them)."""
    if any(u._handle is not None and not u._handle.is_replicated and u._handle.state == SHARDED
           for u in root._units):
        guard.check(root, "forward")
        guard.counted_forward()


def recompute(unit: Any, args: tuple, kwargs: dict) -> Any:
    """forward() during backward: activation checkpointing reruns this unit (see [Note: Recomputation])."""
    root = unit._root
    # Checkpointing around the root: its first forward ran without grad (and ended the
    # iteration), so no pre-backward queued the end of this backward.
    queue_end_of_backward(root)
    if unit._is_root and unit._device.type != "cpu":  # as in its first forward
        args, kwargs = to_device((args, kwargs), unit._device)
    if unit._forward_input_dtype is not None:
        args, kwargs = cast_floating(unit._forward_input_dtype, (args, kwargs))
    handle = unit._handle
    if handle is not None:
        unit._scheduler.wait_for_unshard(handle)
        hand_out_views(unit)
    if unit._is_root:  # the whole model reruns at once
        root.__dict__["_recompute_order"] = []
        root.__dict__["_recomputing"] = True
        try:
            return unit._fsdp_wrapped_module(*args, **kwargs)
        finally:
            root.__dict__["_recomputing"] = False
    output = unit._fsdp_wrapped_module(*args, **kwargs)
    if (
        root.__dict__.get("_recomputing")
        and handle is not None
        and unit._reshard_after_forward
        and unit._sync_gradients
        and not handle.is_replicated
    ):
        # Rerunning the whole model must not hold every unit unsharded at once: reshard as
        # the first forward did. Before any of this unit's backward runs, its pre-backward
        # gathers it again, through the hook of its first forward (non-reentrant
        # checkpointing backpropagates the first graph) or this one (reentrant: this graph).
        order = root._recompute_order
        index = len(order)
        order.append(unit)
        hook = functools.partial(pre_backward, unit, order, index)
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if len(tensors) == 1:
            tensors[0].register_hook(hook)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        reshard(unit)
    return output


def hand_out_views(unit: Any) -> None:
    """Fresh autograd views of the unsharded buffer, through a speculative use (see [Note: Recomputation])."""
    if not unit._flat_param.requires_grad:
        set_views(unit, unit._handle.views())
        return
    use = Use(unit, speculative=True)
    with torch.enable_grad():
        set_views(unit, _UnshardedViews.apply(unit, use, unit._flat_param))


def has_pending_uses(unit: Any) -> bool:
    """Whether a use of this unit still runs its post-backward in this backward (see [Note: Pending uses])."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        return False
    nested = task != unit._root._backward_task
    for use in list(unit._uses):
        if use.done or use.speculative or use.node is None:
            continue
        node = use.node()
        if node is not None and (nested or torch._C._will_engine_execute_node(node)):
            return True
    return False


def prefetch(scheduler: Any, order: list, index: int, backward: bool) -> None:
    """Issues the all-gather of ``order[index]`` without waiting, if it exists, is sharded
    and (in backward) still has a use whose backward has not run."""
    if 0 <= index < len(order):
        unit = order[index]
        handle = unit._handle
        if handle is not None and handle.state == SHARDED and (not backward or has_pending_uses(unit)):
            scheduler.unshard(handle)


# ------------------------------------------------------------------ backward


def queue_end_of_backward(root: Any) -> None:
    """Makes finish_backward run when the backward under way ends. Safe to call twice."""
    if not root._final_callback_queued:
        guard = root.__dict__.get("_rank_guard")
        if guard is not None and root._sync_gradients:  # see [Note: Rank-divergence guard]
            guard.check(root, "backward")
        root._final_callback_queued = True
        root._backward_task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(finish_backward, root))


def pre_backward(unit: Any, order: list, index: int, _grad: Any = None) -> None:
    queue_end_of_backward(unit._root)
    if unit._handle is not None:
        unit._scheduler.wait_for_unshard(unit._handle)  # see forward() on the order
        if unit._placeholders_set:  # resharded after forward: recomputation needs real views
            hand_out_views(unit)
        if unit._backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            prefetch(unit._scheduler, order, index - 1, backward=True)


def post_backward(unit: Any, use: Use, grads: tuple[torch.Tensor | None, ...]) -> None:
    use.finish()
    if unit._use_orig_params:
        _orig_params.note_grads(unit, grads)
    # Reduce once no other use still needs the parameters, unless in no_sync().
    reduce = unit._sync_gradients and not has_pending_uses(unit)
    hooked = reduce and unit._comm_hook is not None
    unit._scheduler.post_backward(
        unit._handle, list(grads), reduce and not hooked, unit._predivide, unit._postdivide,
        unit._replicate_group is not None,
    )
    if not reduce:
        return
    if hooked:  # see [Note: Communication hooks] in _comm_hooks.py
        unit._scheduler.reshard(unit._handle)
        _comm_hooks.reduce(unit)
    if unit._backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        prefetch(unit._scheduler, use.order, use.index - 1, backward=True)
    reshard(unit)


def frozen_post_backward(unit: Any, _grads: Any) -> None:
    if unit._sync_gradients:
        reshard(unit)


def finish_backward(root: Any) -> None:
    """Root only, end of backward: gradient shards written, nothing unsharded (unless no_sync)."""
    root._final_callback_queued = False
    root._in_iteration = False
    for unit in root._units:  # the same order on every rank
        handle = unit._handle
        for use in list(unit._uses):
            use.finish()  # a later backward through a kept graph is a new reduction
        if handle is not None and unit._sync_gradients and handle.has_unsharded_grad():
            # a use whose post-backward never ran
            if unit._comm_hook is not None:
                _comm_hooks.reduce(unit)
            else:
                unit._scheduler.reduce_grad(
                    handle, unit._predivide, unit._postdivide, unit._replicate_group is not None
                )
    root._scheduler.finish_grad_sync()
    for unit in root._units:
        if unit._handle is not None and unit._sync_gradients:
            reshard(unit)
            if unit._use_orig_params:
                _orig_params.use_grad_views(unit)


def abort_backward(root: Any) -> None:
    """Root only: the last backward raised before its end. Drops its partial gradients."""
    logger.warning(
        "flatshard: the previous backward did not finish (it raised); every unit's gradient "
        "(.grad and what no_sync() accumulated) is dropped, so that no rank steps on part of a "
        "batch. Only safe when every rank's backward raised at the same point."
    )
    root._final_callback_queued = False
    root._in_iteration = False
    root._scheduler.abort_grad_sync()
    for unit in root._units:
        for use in list(unit._uses):
            use.finish()
        if unit._handle is not None:
            unit._handle.drop_unsharded_grad()
            unit._flat_param.grad = None
            reshard(unit)
            if unit._use_orig_params:
                _orig_params.use_grad_views(unit)


# ------------------------------------------------------------------ exit

# [Note: Exit]
# gloo keeps each collective's work object on its own worker thread until the
# collective has run, and destroys it there; the object holds the thread-local
# state of the moment it was issued, which can own Python objects. If a
# collective is still in flight when the interpreter shuts down (a backward
# raised on every rank and the script let the exception end it: the
# prefetched all-gather and the reductions of that backward are still
# running), the worker releases that Python object during finalization and
# the process dies by SIGABRT instead of exiting with its traceback and
# status 1. So at exit (atexit runs before finalization) every live root's
# in-flight collectives are waited for, for at most EXIT_DRAIN_SECONDS (a
# collective whose peers will never issue it is abandoned: it will not complete
# during finalization either), then briefly more, for the workers to drop the
# objects they finished with. Nothing else changes: no collective is issued.

EXIT_DRAIN_SECONDS = 10.0
_live_roots: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_for_exit(root: Any) -> None:
    _live_roots.add(root)


def _drain_at_exit() -> None:
    waited = False
    deadline = time.monotonic() + EXIT_DRAIN_SECONDS  # for all roots together
    for root in list(_live_roots):
        scheduler = root.__dict__.get("_scheduler")
        if scheduler is None:
            continue
        try:
            _, had_any = scheduler.drain(max(0.0, deadline - time.monotonic()))
            waited = waited or had_any
        except Exception:  # noqa: BLE001 (exiting: nothing to report it to)
            pass
    if waited:
        time.sleep(0.05)


atexit.register(_drain_at_exit)


@contextlib.contextmanager
def no_sync(root: Any) -> Iterator[None]:
    """See ``FullyShardedDataParallel.no_sync`` and [Note: no_sync]."""
    if root._is_root is None:
        root._lazy_init()
    if not root._is_root:
        raise RuntimeError(
            f"FullyShardedDataParallel.no_sync: expected the root unit but '{root._unit_name}' is "
            f"nested; call no_sync() on the outermost FSDP module."
        )
    previous = [(u, u._sync_gradients) for u in root._units]
    for unit in root._units:
        unit._sync_gradients = False
    try:
        yield
    finally:
        for unit, value in previous:
            unit._sync_gradients = value
