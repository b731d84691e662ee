"""What torch's own code reads of a fully_shard module: FSDP2's state object (pipelining) and the composable APIs'
registry (replicate).

[Note: Pipelining reduces the gradients itself]
``torch.distributed.pipelining`` runs every micro-batch's backward of a stage with gradient sync off
(``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), then reduces the accumulated
gradients itself once the schedule's backwards are done (``_PipelineStageBase.perform_reduce_grad``, at the end of
every schedule's ``step``: GPipe, 1F1B, the interleaved and looped ones): it turns sync back on and, through torch's
``fully_shard.state(stage.submod)``, calls ``post_backward()`` of every parameter group of every FSDP state under the
stage's module (``state._state_ctx.all_states``, ``._fsdp_param_groups``), then the state's
``_root_post_backward_final_callback()``. ``fully_shard.state`` reads torch's contract registry in the module's
``__dict__``, where torch's ``fully_shard`` puts its ``FSDPState``; flatshard's ``fully_shard`` puts a
``PipelinedState`` there instead (``register``), which answers those names and nothing else (under the opt-in, the
name pipelining imported is bound to flatshard's ``fully_shard`` in a wrapper that keeps torch's ``.state``; flatshard's
own ``fully_shard.state`` reads the same place):
- a group's ``post_backward()``: the unit's pending gradient reduced (``_runtime.reduce_pending``) and the unit
  resharded, as torch's group does;
- ``_root_post_backward_final_callback()``: the root's end of backward (``_runtime.finish_backward``): the
  reductions completed, the gradients handed out as the parameters' ``.grad``, every unit resharded.
So the stage's gradients are the same as torch's FSDP2 gives (tests/test_fully_shard_pipelining.py). Only the
module's own ``__dict__`` is touched, only on modules flatshard's ``fully_shard`` made; any other attribute raises,
naming the module (torch's ``fully_shard`` applied over the module again raises torch's "applied to a module once": see
[Note: Composing with torch's replicate]).

The split backward of the zero-bubble schedules is not supported: it differentiates with respect to each parameter
as a leaf, where flatshard's unsharded parameters are outputs of one autograd node per unit, and sets the result as
``.grad`` of the unsharded parameter, which no flatshard reduction reads (torch's code then fails on its own, with a
KeyError on flatshard's node or a gradient of another parameter's size, or trains without those gradients). So
``set_requires_gradient_sync``, which the stage calls right before each half of it, refuses it by name
(``refuse_split_backward_caller``), and the final callback refuses a step whose backwards never computed a unit's
parameters' gradients (where torch's frames were renamed). See README's "FSDP2 API".
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem, _get_registry
from torch.distributed.fsdp import fully_shard as torch_fully_shard

# The key torch's contract files a module's FSDPState under: the function ``@contract`` wrapped (its ``.state`` reads
# the module's ``__dict__[STATE_KEY][func]``).
_TORCH_KEY = getattr(torch_fully_shard, "__wrapped__", None)


def register(module: nn.Module) -> None:
    """Files ``module``'s ``PipelinedState`` where torch's ``fully_shard.state(module)`` reads (see the Note), and
    ``fully_shard`` in torch's registry of composable APIs (see [Note: Composing with torch's replicate])."""
    if _TORCH_KEY is not None:
        module.__dict__.setdefault(STATE_KEY, {})[_TORCH_KEY] = PipelinedState(module)
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())


# [Note: Composing with torch's replicate]
# torch's composable APIs record themselves in a registry in each module's ``__dict__`` (``_get_registry``), which the
# others read: torch's ``replicate`` (DDP) leaves the parameters of a module marked ``fully_shard`` to it, and
# ``fully_shard`` leaves those of a module marked ``replicate`` to DDP. flatshard's ``fully_shard`` marks its modules
# so (torch's ``fully_shard`` or ``replicate`` applied to one again then raises torch's "applied to a module once"),
# and takes the parameters under a module marked ``replicate`` as ignored parameters (``with_replicated_params``).
def with_replicated_params(modules: list[nn.Module], ignored_params: Any) -> Any:
    """``ignored_params`` and every parameter under a module torch's ``replicate`` manages (see the Note above)."""
    replicated = {id(p): p for m in modules for sub in m.modules()
                  if "replicate" in (_get_registry(sub) or ()) for p in sub.parameters()}
    if not replicated:
        return ignored_params
    return set(ignored_params or ()) | set(replicated.values())


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
        return _StateContext([_state_of(unit) for unit in root.units])

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroup]:
        s = self._module._unit_state
        return [_ParamGroup(s)] if s.handle is not None else []

    def _root_post_backward_final_callback(self) -> None:
        from flatshard import _runtime

        root = _runtime.require_root(self._module, "FSDP's final callback runs on the root FSDP module only")
        if root.final_callback_queued:  # inside a backward: its end runs it
            return
        _refuse_split_backward(root)
        _runtime.finish_backward(root)

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
        from flatshard import _runtime

        s = self._state
        if s.root is None or s.root.final_callback_queued:  # (never ran; inside a backward its own post-backward runs)
            return
        _runtime.reduce_pending(s)
        if s.reshards_after_backward and not s.holds_unsharded:
            _runtime.reshard(s)


def _state_of(unit: nn.Module) -> PipelinedState:
    return state_of(unit) or PipelinedState(unit)


def refuse_split_backward_caller(module: nn.Module) -> None:
    """``set_requires_gradient_sync`` called by pipelining's stage right before a split backward's half (its
    ``backward_maybe_with_nosync`` with ``backward_type`` "input" or "weight"): refused there, before torch's split
    backward fails in its own code (a KeyError on flatshard's views' node, or a gradient of another parameter's size)
    or, where it would not, trains without those gradients (see the Note). One frame read, in a call made once a
    backward."""
    caller = sys._getframe(2)  # (its caller's caller: set_requires_gradient_sync's)
    if caller.f_code.co_name == "backward_maybe_with_nosync" and caller.f_locals.get("backward_type") in ("input",
                                                                                                           "weight"):
        raise NotImplementedError(
            f"flatshard: torch.distributed.pipelining runs a split backward ('{caller.f_locals['backward_type']}' "
            f"half, the zero-bubble schedules) through {type(module).__name__}: {_SPLIT_BACKWARD}")


def _refuse_split_backward(root: Any) -> None:
    """Where the caller's check above did not see it (torch renamed its frames): the split backward's input half
    reached a unit but never its parameters' gradients (flatshard's post-backward never ran for it since), and no
    gradient is pending: refused rather than reduce nothing and train without them."""
    for unit in root.units:
        s = unit._unit_state
        if s.handle is not None and s.params_skipped and s.flat_param.requires_grad and \
                not s.handle.has_unsharded_grad():
            raise NotImplementedError(
                f"flatshard: the backwards of this pipeline step reached unit '{s.label}' but never computed its "
                f"parameters' gradients (torch.distributed.pipelining's split backward, stage_backward_input / "
                f"stage_backward_weight, of the zero-bubble schedules): {_SPLIT_BACKWARD}")


_SPLIT_BACKWARD = ("flatshard's fully_shard does not support the split backward, whose weight gradients it would not "
                   "reduce. Use a schedule without it (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, "
                   "ScheduleLoopedBFS), or torch's fully_shard.")
