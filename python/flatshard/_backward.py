"""A unit's backward: its pre-backward and post-backward, the root's end of backward (see [Note: Unit lifecycle],
[Note: Recomputation] and [Note: Pending uses] in _runtime.py, where the forward and the views' autograd node that call
in here are)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from flatshard import _comm_hooks, _dtensor_params, _orig_params, _prefetch, _rank_guard, _runtime, _tensor_parallel
from flatshard._common import UsageError, logger
from flatshard._state import RootState, TrainingState, UnitState
from flatshard.api import BackwardPrefetch

if TYPE_CHECKING:
    from flatshard._runtime import Use

FORWARD, SUMMONING = TrainingState.FORWARD, TrainingState.SUMMONING


def queue_end_of_backward(root: RootState) -> None:
    """Makes finish_backward run when the backward under way ends. Safe to call twice."""
    if not root.final_callback_queued:
        if root.guard is not None and not root.unit._unit_state.holds_unsharded:  # see [Note: Rank-divergence guard]
            root.guard.check(root, "backward")
        # What the user did to the gradients since the last backward (a zero_grad, also one after this forward), before
        # this one adds into them (see [Note: A gradient set to None is freed] in _orig_params.py).
        for u in root.orig_param_units:
            _orig_params.write_back_grads(u._unit_state)
        root.in_iteration = True  # (a backward with no forward since the last one: through a kept graph)
        root.final_callback_queued = True
        root.backward_task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(finish_backward, root))


# [Note: A backward inside the forward]
# A model may differentiate inside its own forward: a force field's forward computes the energy, then
# the forces as ``torch.autograd.grad(energy, positions, create_graph=True)``, and the training loss
# uses both. That inner backward runs through units whose forward is over (resharded after it, for
# FULL_SHARD) while the root's forward is still running. It is not the training step's backward: it
# must not end the iteration, switch the units' states, reduce or reshard. So while the root's forward
# runs, a unit's pre-backward only gathers the unit again and hands out fresh views (the graph that
# create_graph builds saves them for the step's backward); the unit stays unsharded until its
# post-backward in the step's backward. Without create_graph nothing keeps them: the units that
# inner backward gathered are freed when it ends. Gradients of parameters inside the forward (their views'
# backward running there) are refused by name: they would be reduced in the middle of a forward.


def _gather_for_inner_backward(s: UnitState) -> None:
    if s.handle is None:
        return
    views = s.root.scheduler.wait_for_unshard(s.handle, None, views=s.placeholders_set or s.explicit_unshard)
    if views is not None:
        _runtime.hand_out_views(s, views)
    if not torch.is_grad_enabled() and _runtime.frees_after_forward(s):
        # Without create_graph no graph keeps the views: the unit is freed when that backward ends (else every unit
        # it ran through would stay gathered at once).
        root = s.root
        if not root.inner_gathered:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end_inner_backward, root))
        root.inner_gathered.append(s)


def _end_inner_backward(root: RootState) -> None:
    gathered, root.inner_gathered = root.inner_gathered, []
    for s in gathered:
        _runtime.reshard(s)


def _refuse_backward(s: UnitState) -> None:
    """A backward through a unit that is summoned, or inside its own forward, is the caller's misuse: raises
    (the hooks test the state inline, a call less per unit on the hot path)."""
    if s.training_state is SUMMONING:
        raise UsageError(
            f"FullyShardedDataParallel: a backward through unit '{s.label}' ran inside summon_full_params; run "
            f"backward outside it (its parameters are the full ones there, not the shards autograd saw).")
    if s.training_state is FORWARD:
        raise UsageError(
            f"FullyShardedDataParallel: a backward through unit '{s.label}' ran during its own forward (e.g. "
            f"torch.autograd.grad inside forward through an earlier call of the same unit); as with torch's "
            f"FSDP1, compute such gradients outside the unit's forward.")


def pre_backward(s: UnitState, order: list, index: int, _grad: Any = None) -> None:
    if s.training_state is SUMMONING or s.training_state is FORWARD:
        _refuse_backward(s)
    if s.root.in_forward_call:  # see [Note: A backward inside the forward]
        _gather_for_inner_backward(s)
        return
    if not s.root.final_callback_queued:
        queue_end_of_backward(s.root)
    if s.handle is not None:
        s.switch("pre-backward")
        root = s.root
        if root.gathered_ahead:
            root.gathered_ahead.discard(s)
        explicit = s.backward_prefetch_to
        ahead, group = (_prefetch.backward(root, order, index - 1)
                        if s.config.backward_prefetch == BackwardPrefetch.BACKWARD_PRE and explicit is None
                        else (None, None))
        # Resharded after forward: recomputation needs real views. One crossing (see forward()).
        views = root.scheduler.wait_for_unshard(s.handle, ahead, views=s.placeholders_set or s.explicit_unshard)
        if group:
            _prefetch.unshard_group(root, group)
        if views is not None:
            _runtime.hand_out_views(s, views)
        if explicit:
            _prefetch.explicit(s.root, explicit)


def post_backward(s: UnitState, use: Use, grads: tuple[torch.Tensor | None, ...]) -> None:
    if s.training_state is SUMMONING or s.training_state is FORWARD:
        _refuse_backward(s)
    if s.root.in_forward_call:  # see [Note: A backward inside the forward]
        raise UsageError(
            f"FullyShardedDataParallel: a backward inside the model's forward computed gradients of unit "
            f"'{s.label}''s parameters (torch.autograd.grad over parameters, or backward(), during forward); "
            f"flatshard supports gradients of the forward's inputs there (torch.autograd.grad(energy, positions, "
            f"create_graph=True)), not of the parameters: take those in the training step's backward.")
    if s.training_state is TrainingState.IDLE and torch._C._current_graph_task_id() != -1:
        # A backward that reached the unit's parameters but none of its outputs (a loss on a tensor the module kept,
        # e.g. a mixture-of-experts' auxiliary loss backpropagated on its own; the parameters kept unsharded after
        # forward): the unit's pre-backward, without a prefetch order, first, as torch's FSDP2 runs it.
        pre_backward(s, [], 0)
    s.switch("post-backward")
    use.finish()
    if s.config.use_orig_params:
        _orig_params.note_grads(s, grads)
    # Reshard once no other use still needs the parameters (unless the unit keeps them), and reduce then,
    # unless in no_sync().
    done = not s.holds_unsharded and not _runtime.has_pending_uses(s)
    reduce = done and s.sync_gradients
    reshard_unit = done and s.reshards_after_backward
    hooked = reduce and s.comm_hook is not None
    ahead = (_prefetch.backward_target(use.order, use.index - 1)
             if done and s.config.backward_prefetch == BackwardPrefetch.BACKWARD_POST else None)
    # (tensor-parallel partial gradients: all-reduced over TP before the reduction, see [Note: Partial gradients of
    # tensor-parallel parameters] in _tensor_parallel.py)
    partials = done and s.tp_params and _tensor_parallel.has_partials(s)
    if reduce and s.grads_handed_out:  # reduced again in this backward: into what the hooks left (see [Note:
        _orig_params.write_back_grads(s)  # Post-accumulate-grad hooks] in _dtensor_params.py)
    # One crossing: see [Note: One crossing per lifecycle step] in bindings.cpp.
    s.root.scheduler.post_backward(s.handle, list(grads), reduce and not hooked and not partials, done, reshard_unit,
                                   None if hooked else ahead)
    if partials:
        if reduce:
            _tensor_parallel.reduce(s)
        else:
            _tensor_parallel.end_backward(s)
    if reshard_unit:
        _runtime.set_views(s, s.placeholders, placeholders=True)
    if hooked:  # see [Note: Communication hooks] in _comm_hooks.py
        _comm_hooks.reduce(s)
        if ahead is not None:
            s.root.scheduler.unshard(ahead)
    root = s.root
    if reduce and s.config.dim0_layout and s not in root.hooks_waiting and \
            _dtensor_params.has_post_accumulate_grad_hooks(s):  # (waiting already: one hand-out covers both reductions)
        root.hooks_waiting.append(s)
    if root.hooks_waiting:
        _run_post_accumulate_grad_hooks(root)


def _run_post_accumulate_grad_hooks(root: RootState) -> None:
    """The gradients of the units waiting for their post-accumulate-grad hooks, as far as their reductions have been
    issued (a small unit's waits to go together with the next units'), completed, handed out and their hooks called
    (see [Note: Post-accumulate-grad hooks] in _dtensor_params.py)."""
    scheduler = root.scheduler
    ready = 0  # (reductions are issued in post-backward order: the ready ones come first)
    while ready < len(root.hooks_waiting) and not scheduler.reduction_deferred(root.hooks_waiting[ready].handle):
        ready += 1
    if not ready:
        return
    units, root.hooks_waiting = root.hooks_waiting[:ready], root.hooks_waiting[ready:]
    try:
        scheduler.complete_issued_reductions()
    except BaseException:  # (as at the end of backward: a fully_shard all-reduce hook's error)
        abort_backward(root)
        raise
    hooked = []
    for s in units:
        hooked += _hand_out_grads(s)
    _dtensor_params.run_post_accumulate_grad_hooks(hooked)


def _hand_out_grads(s: UnitState) -> list[torch.Tensor]:
    """A unit's gradients handed out before the end of the backward; the parameters whose hooks are to run."""
    if s.root.guard is not None:  # (before the gradient shard is let go of: see record_gradient_pattern)
        s.gradient_gaps = _rank_guard.gradient_gaps(s)
    s.grads_handed_out = True
    return _orig_params.hand_out_grads(s)


def reduce_pending(s: UnitState) -> None:
    """Issues the reduction of the gradients the unit holds unreduced, where its gradients are synced: a use's whose
    post-backward never ran, at the end of a backward; micro-batches' accumulated without sync, which torch's
    pipelining reduces itself (see [Note: Pipelining reduces the gradients itself] in _torch_facade/fsdp2_state.py)."""
    handle = s.handle
    if handle is None or not s.sync_gradients or not handle.has_unsharded_grad():
        return
    if s.comm_hook is not None:
        _comm_hooks.reduce(s)
    elif s.tp_params and _tensor_parallel.has_partials(s):
        _tensor_parallel.reduce(s)
    else:
        s.root.scheduler.reduce_grad(handle)


def frozen_post_backward(s: UnitState, _grads: Any) -> None:
    if s.root.in_forward_call:  # see [Note: A backward inside the forward]
        return
    s.switch("frozen post-backward")
    if not s.holds_unsharded and s.reshards_after_backward:
        _runtime.reshard(s)


def finish_backward(root: RootState) -> None:
    """Root only, end of backward: gradient shards written, nothing unsharded (unless no_sync)."""
    root.final_callback_queued = False
    root.in_iteration = False
    root.gathered_ahead.clear()  # (each is resharded below, or kept unsharded by its config)
    for unit in root.units:  # the same order on every rank
        s = unit._unit_state
        for use in _runtime.live_uses(s):
            use.finish()  # a later backward through a kept graph is a new reduction
        reduce_pending(s)  # (a use whose post-backward never ran)
    try:
        root.scheduler.finish_grad_sync()
    except BaseException:  # (a fully_shard all-reduce hook's error: the backward's gradients dropped, as any raised)
        abort_backward(root)
        raise
    # (Units waiting for their hooks first, in post-backward order; every hook runs once every unit is done: one that
    # raises leaves no unit half-way.)
    waiting, root.hooks_waiting = root.hooks_waiting, []
    hooked = [p for s in waiting for p in _hand_out_grads(s)]
    if root.guard is not None:  # see [Note: Gradients given on some ranks only] in _rank_guard.py
        _rank_guard.record_gradient_pattern(root)  # (before use_grad_views lets go of the flat gradients)
    for unit in root.units:
        s = unit._unit_state
        s.switch("end of backward")
        handed_out, s.grads_handed_out = s.grads_handed_out, False  # (in its post-backward)
        if s.handle is not None and not s.holds_unsharded:
            if s.reshards_after_backward:
                _runtime.reshard(s)
            if s.config.use_orig_params and s.sync_gradients and not handed_out:  # (reduced, resharded or not)
                hooked += _orig_params.hand_out_grads(s)
    _dtensor_params.run_post_accumulate_grad_hooks(hooked)


def abort_backward(root: RootState) -> None:
    """Root only: the last backward raised before its end. Drops its partial gradients."""
    logger.warning(
        "flatshard: the previous backward did not finish (it raised); every unit's gradient "
        "(.grad and what no_sync() accumulated) is dropped, so that no rank steps on part of a "
        "batch. Only safe when every rank's backward raised at the same point."
    )
    root.final_callback_queued = False
    root.in_iteration = False
    root.gathered_ahead.clear()
    root.hooks_waiting = []
    root.scheduler.abort_grad_sync()
    for unit in root.units:
        s = unit._unit_state
        s.switch("abort of backward")
        s.grads_handed_out = False
        for use in _runtime.live_uses(s):
            use.finish()
        if s.handle is not None:
            s.handle.drop_unsharded_grad()
            if s.tp_params:
                _tensor_parallel.drop(s)
            s.flat_param.grad = None
            _runtime.reshard(s)
            if s.config.use_orig_params:
                _orig_params.use_grad_views(s)
