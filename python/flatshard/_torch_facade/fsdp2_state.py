"""torch FSDP2's state object, as far as torch's own code (pipelining) reads it from a fully_shard module.

[Note: Pipelining reduces the gradients itself]
``torch.distributed.pipelining`` runs every micro-batch's backward of a stage with gradient sync off
(``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), then reduces the accumulated
gradients itself once the schedule's backwards are done (``_PipelineStageBase.perform_reduce_grad``, at the end of
every schedule's ``step``: GPipe, 1F1B, the interleaved and looped ones): it turns sync back on and, through torch's
``fully_shard.state(stage.submod)``, calls ``post_backward()`` of every parameter group of every FSDP state under the
stage's module (``state._state_ctx.all_states``, ``._fsdp_param_groups``), then the state's
``_root_post_backward_final_callback()``. ``fully_shard.state`` reads torch's contract registry in the module's
``__dict__``, where torch's ``fully_shard`` puts its ``FSDPState``; flatshard's ``fully_shard`` puts a
``PipelinedState`` there instead (``register``), which answers those names and nothing else (pipelining's module
keeps torch's ``fully_shard`` under the opt-in too, whose ``.state`` reads that place; flatshard's own
``fully_shard.state`` reads it as well):
- a group's ``post_backward()``: the unit's pending gradient reduced (``_backward.reduce_pending``) and the unit
  resharded, as torch's group does;
- ``_root_post_backward_final_callback()``: the root's end of backward (``_backward.finish_backward``): the
  reductions completed, the gradients handed out as the parameters' ``.grad``, every unit resharded.
So the stage's gradients are the same as torch's FSDP2 gives (tests/test_fully_shard_pipelining.py). Only the
module's own ``__dict__`` is touched, only on modules flatshard's ``fully_shard`` made; any other attribute raises,
naming the module.

The split backward of the zero-bubble schedules is not supported: it differentiates with respect to each parameter
as a leaf, where flatshard's unsharded parameters are outputs of one autograd node per unit, and sets the result as
``.grad`` of the unsharded parameter, which no flatshard reduction reads (torch's code then fails on its own, with a
KeyError on flatshard's node or a gradient of another parameter's size). So ``set_requires_gradient_sync``, which the
stage calls right before each half of it, refuses it by name (``refuse_split_backward_caller``). The refusal is a
rank's own, as any error in a pipeline step: a rank whose stage runs no such half (the first stage runs the weight half
as a full backward) goes on and waits for its peer in point-to-point until the group's timeout. See README's "FSDP2
API".
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed.fsdp import fully_shard as torch_fully_shard

# The key torch's contract files a module's FSDPState under: the function ``@contract`` wrapped (its ``.state`` reads
# the module's ``__dict__[STATE_KEY][func]``).
_TORCH_KEY = getattr(torch_fully_shard, "__wrapped__", None)


def register(module: nn.Module) -> None:
    """Files ``module``'s ``PipelinedState`` where torch's ``fully_shard.state(module)`` reads (see the Note)."""
    if _TORCH_KEY is not None:
        module.__dict__.setdefault(STATE_KEY, {})[_TORCH_KEY] = PipelinedState(module)


def state_of(module: nn.Module) -> Any:
    """What torch's ``fully_shard.state(module)`` returns: torch's FSDPState, a flatshard module's PipelinedState, or
    None."""
    return module.__dict__.get(STATE_KEY, {}).get(_TORCH_KEY)


class PipelinedState:
    """What ``torch.distributed.fsdp.fully_shard.state(module)`` returns for a flatshard module (see the Note)."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    @property
    def _state_ctx(self) -> _StateContext:
        from flatshard import _runtime

        root = _runtime.require_root(self._module, "FSDP's final callback runs on the root FSDP module only")
        return _StateContext([_pipelined_state_or_new(unit) for unit in root.units])

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroup]:
        s = self._module._unit_state
        return [_ParamGroup(s)] if s.handle is not None else []

    def _root_post_backward_final_callback(self) -> None:
        from flatshard import _backward, _runtime

        root = _runtime.require_root(self._module, "FSDP's final callback runs on the root FSDP module only")
        if root.final_callback_queued:  # inside a backward: its end runs it
            return
        _backward.finish_backward(root)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"flatshard: torch's FSDP2 state attribute '{name}' was read from {type(self._module).__name__} "
            f"(torch.distributed.fsdp.fully_shard.state(module)); a flatshard fully_shard module answers only what "
            f"torch.distributed.pipelining reads (see [Note: Pipelining reduces the gradients itself]); use the "
            f"FSDPModule methods instead.")


class _StateContext:
    __slots__ = ("all_states",)

    def __init__(self, all_states: list[PipelinedState]) -> None:
        self.all_states = all_states


class _ParamGroup:
    """One unit's parameter group: its ``post_backward()`` reduces what the unit accumulated and reshards it."""

    __slots__ = ("_state",)

    def __init__(self, state: Any) -> None:
        self._state = state

    def post_backward(self, *_unused: Any) -> None:
        from flatshard import _backward, _runtime

        s = self._state
        if s.root is None or s.root.final_callback_queued:  # (never ran; inside a backward its own post-backward runs)
            return
        _backward.reduce_pending(s)
        if s.reshards_after_backward and not s.holds_unsharded:
            _runtime.reshard(s)


def _pipelined_state_or_new(unit: nn.Module) -> PipelinedState:
    return state_of(unit) or PipelinedState(unit)


def refuse_split_backward_caller(module: nn.Module) -> None:
    """``set_requires_gradient_sync`` called by pipelining's stage right before a split backward's half (its
    ``backward_maybe_with_nosync`` with ``backward_type`` "input" or "weight"): refused there, before torch's split
    backward fails in its own code (a KeyError on flatshard's views' node, or a gradient of another parameter's size)
    or, where it would not, trains without those gradients (see the Note). One frame read, in a call made once a
    backward."""
    try:
        caller = sys._getframe(2)  # (its caller's caller: set_requires_gradient_sync's)
    except ValueError:  # (called from C, with no Python caller)
        return
    if caller.f_code.co_name == "backward_maybe_with_nosync" and caller.f_locals.get("backward_type") in ("input",
                                                                                                           "weight"):
        raise NotImplementedError(
            f"flatshard: torch.distributed.pipelining runs a split backward ('{caller.f_locals['backward_type']}' "
            f"half, the zero-bubble schedules) through {type(module).__name__}: {_SPLIT_BACKWARD}")


_SPLIT_BACKWARD = ("flatshard's fully_shard does not support the split backward, whose weight gradients it would not "
                   "reduce. Use a schedule without it (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, "
                   "ScheduleLoopedBFS), or torch's fully_shard.")
