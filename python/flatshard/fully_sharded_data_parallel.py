"""``FullyShardedDataParallel``: torch's FSDP interface over the flatshard runtime.

Each instance is one *unit*: it owns every parameter of its subtree that no
inner unit owns, flattened into one ``FlatParamHandle`` (C++) whose local shard is the
``nn.Parameter`` registered here as ``_flat_param``. Its state is one ``UnitState``
(``_unit_state``); the root (outermost unit) holds a ``RootState`` with one
``Scheduler`` (C++) shared by all units below it (see [Note: Unit state]).

This file is the public API; each concern lives in its own private module:
- ``_fsdp1_config``: this class's arguments, resolved once into the frozen ``UnitConfig`` (``_config``) the
  runtime reads (groups, strategy, prefetch, dtypes, offload, ignored states)
- ``_state``: the one typed state per unit (``UnitState``) and per root (``RootState``)
- ``_construction``: building a unit from its configuration: device, meta-device materialization, sync, the
  flat parameter
- ``_runtime``: lazy init and the per-step lifecycle (forward, pre/post-backward, end of backward, no_sync)
- ``_full_params``: summon_full_params, apply
- ``_clip_grad_norm``: clip_grad_norm_
- ``_state_dict``: state_dict (FULL) and the state dict type settings
- ``_sharded_state_dict``: SHARDED and LOCAL state dicts (ShardedTensors, DTensors)
- ``_state_dict_load``: load_state_dict of all three types
- ``_optim_state_dict``: optimizer state dicts
- ``_broadcast``: rank 0's state dict on every rank, tensor by tensor
- ``_host_offload``: moving the shards (and the optimizer's state) to host memory and back
- ``_orig_params``: use_orig_params (the original parameters as views of the shard)
- ``_mixed_precision``: MixedPrecision's dtypes, casts and gradient division
- ``_comm_hooks``: register_comm_hook's hooks in the reduction
- ``_rank_guard`` (and ``_guard_links``, its links): ranks about to run different collectives raise
- ``_stall_watch``: waits that can never complete raise on every rank
- ``_stale_optimizer``: an optimizer built before wrapping is refused by name
- ``_exit``: the interpreter's exit with collectives in flight
- ``_profiling``: the profiler ranges of collectives and waits
- ``_torch_facade``: torch FSDP1's surface: its attributes (process_group, params, training_state, ...),
  internals frameworks reach for, and the opt-in that makes torch's class flatshard's, from one table
- ``_common``: shared names and helpers; ``api``: torch's enums and configs; ``wrap``: auto-wrap policies
- ``checkpoint/``: get/set_state_dict, crash-safe save and load, streaming export; ``plan/``: the planner
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from flatshard import (
    _clip_grad_norm,
    _comm_hooks,
    _construction,
    _fsdp1_config,
    _full_params,
    _mixed_precision,
    _optim_state_dict,
    _orig_params,
    _runtime,
    _state_dict,
    _state_dict_load,
)
from flatshard._common import (
    CHECKPOINT_WRAPPED,
    FLAT_PARAM,
    WRAPPED,
    clean_name,
    fsdp_modules,
    is_unit,
    join,
)
from flatshard._config import UnitConfig
from flatshard._state import TrainingState, UnitState
from flatshard._torch_facade.attributes import TorchAttributes, mark_flat_parameter
from flatshard._torch_facade.internals import missing_attribute
from flatshard.checkpoint._state_dict_api import TORCH_HELPERS_ERROR
from flatshard.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from flatshard.wrap import _plan_wraps

__all__ = ["FullyShardedDataParallel"]

def _wrap_children(cls: type[FullyShardedDataParallel], module: nn.Module, policy: Any, config: UnitConfig,
                   unit_name: str) -> None:
    """Wraps the modules below ``module`` that ``policy`` names, innermost first, each in a unit of the same
    configuration (or its overrides'); modules of mixed precision's ignored classes in float32 units."""
    names = {m: name for name, m in module.named_modules()}
    individually = _mixed_precision.individually_wrapped(config.mixed_precision)
    plan = _plan_wraps(module, policy, config.ignored_modules, config.ignored_params, is_unit, individually)
    _mixed_precision.run_in_fp32(
        [m for m, o in plan if individually and isinstance(m, individually) and o.get("mixed_precision", 0) is None])
    parents = _construction.parent_slots(module)
    for target, overrides in plan:
        parent, attr = parents[target]
        inner_policy = overrides.pop("auto_wrap_policy", None)  # (a policy of its own, for its subtree)
        child_config = _fsdp1_config.resolve_overrides(config, target, overrides)
        setattr(parent, attr, cls(target, auto_wrap_policy=inner_policy, _config=child_config,
                                  _unit_name=join(unit_name, names[target])))


class FullyShardedDataParallel(TorchAttributes, nn.Module):
    """Shards a module's parameters across ranks; a drop-in for torch's FSDP (FSDP1).

    The constructor takes torch's arguments. Implemented: ``module``,
    ``process_group`` (a group, or a (shard, replicate) tuple for hybrid),
    ``sharding_strategy`` (all five), ``auto_wrap_policy`` (ours or torch's),
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``,
    ``ignored_modules``, ``ignored_states``, ``param_init_fn``, ``device_id``,
    ``sync_module_states``, ``device_mesh``, ``mixed_precision`` (torch's
    ``MixedPrecision``, every field) and ``cpu_offload`` (torch's
    ``CPUOffload``) and ``use_orig_params``.

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

    _is_flatshard_unit = True  # see _common.is_unit

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
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
        _config: UnitConfig | None = None,
    ):
        arguments = dict(locals())  # (first: the constructor's arguments by name, for _fsdp1_config.resolve)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FullyShardedDataParallel: module: expected an nn.Module but got {type(module).__name__}; pass the "
                f"model to wrap (FSDP(model)), not a tensor or its parameters.")
        nn.Module.__init__(self)  # (not super(): see [Note: flatshard as torch's FSDP] in _torch_facade/opt_in.py)
        if _config is None:  # the unit the user wraps: its arguments, resolved once (see [Note: Unit configuration])
            _config = _fsdp1_config.resolve(module, arguments)
        # The unit's one home for its state (see [Note: Unit state] in _state.py).
        self.__dict__["_unit_state"] = UnitState(_unit_name, module, _config,
                                                 _construction.unit_device(_config.device_id, module))
        if auto_wrap_policy is not None:
            _wrap_children(type(self), module, auto_wrap_policy, _config, _unit_name)
        self._fsdp_wrapped_module = module
        state = self._unit_state
        _construction.build_flat_param(self, module)
        if state.handle is not None:
            _runtime.set_views(state, state.placeholders, placeholders=True)
            mark_flat_parameter(state)  # (torch FlatParameter's fields)
        _state_dict_load.register_load_hooks(self)

    # --------------------------------------------------------------- runtime

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return _runtime.forward(self, args, kwargs)
        except BaseException as error:
            _runtime.forward_raised(self, error)
            raise

    def no_sync(self, keep_parameters_unsharded: bool = False) -> contextlib.AbstractContextManager[None]:
        """Accumulates gradients locally, with no gradient reduction, inside the context.

        Call it on the root. The first backward after leaving the context
        reduces the accumulated gradients once. As torch's FSDP1, each unit's
        gradient is held unsharded meanwhile and parameters are resharded and
        gathered as outside the context. ``keep_parameters_unsharded=True``
        (flatshard's) also keeps every unit's parameters unsharded from its first
        forward in the context on: no collective at all during the accumulation,
        for the memory of the unsharded parameters too. See [Note: no_sync].
        """
        return _runtime.no_sync(self, keep_parameters_unsharded)

    def _lazy_init(self) -> None:
        """Makes this unit the root of every unit below it; creates the shared scheduler."""
        if self._unit_state.is_root is None:
            _runtime.lazy_init(self)

    def _has_pending_uses(self) -> bool:
        return _runtime.has_pending_uses(self._unit_state)

    # ------------------------------------------------------- torch's methods

    def _apply(self, fn: Callable, recurse: bool = True) -> "FullyShardedDataParallel":
        # .to(), .cuda(), .half(), .double() and friends. A cast (same device) is applied to the
        # shards, as torch's FSDP does; a move would leave the runtime's buffers behind and is refused.
        state = self._unit_state
        if state.training_state is TrainingState.SUMMONING:
            # Inside summon_full_params the module holds its full parameters: they move or cast (verl moves
            # the base model with .to("cpu") there); the shards stay as they are, and writeback copies edits back.
            # (A rank that shows none, with rank0_only, still has its flat parameter registered: it stays too.)
            flat = self._parameters.pop(FLAT_PARAM, None)
            try:
                return nn.Module._apply(self, fn, recurse)
            finally:
                if flat is not None:
                    self._parameters[FLAT_PARAM] = flat
        flat = state.flat_param
        cast = False
        if flat is not None:
            probe = fn(torch.empty(0, dtype=flat.dtype, device=flat.device))
            if probe.device != flat.device:
                fix = ("with cpu_offload the shards stay on the host on purpose: leave the module where it is"
                       if state.config.offload_params else
                       "Move the module before wrapping it (device_id= moves it at wrap time)")
                raise ValueError(
                    f"FullyShardedDataParallel: unit '{state.label}': expected no move after "
                    f"wrapping but got {flat.device} -> {probe.device}. {fix}."
                )
            cast = probe.dtype != flat.dtype
            if cast and state.config.use_orig_params:  # the flat shard first: the parameters are views of it
                _orig_params.writeback(state)  # (a zero_grad since the last step included)
                with torch.no_grad():
                    flat.data = flat.data.to(probe.dtype)
                    if flat.grad is not None:
                        flat.grad = flat.grad.to(probe.dtype)
        out = nn.Module._apply(self, fn, recurse)
        if cast:
            _runtime.after_shard_cast(state)
        return out

    @property
    def module(self) -> nn.Module:
        """The wrapped module; under an activation-checkpoint wrapper put around it after wrapping, the module
        inside that wrapper (as torch's)."""
        wrapped = self._fsdp_wrapped_module
        inner = wrapped._modules.get(CHECKPOINT_WRAPPED) if isinstance(wrapped, ActivationWrapper) else None
        return inner if inner is not None else wrapped

    def __setattr__(self, name: str, value: Any) -> None:
        # The wrapped module replaced after wrapping (apply_activation_checkpointing after wrapping
        # puts a checkpoint wrapper around it, as accelerate and Lightning do): the runtime calls the new one.
        if name == WRAPPED and "_unit_state" in self.__dict__:
            self._unit_state.wrapped_module = value
        nn.Module.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name == "_unit_state" and WRAPPED in self._modules:
                raise AttributeError(
                    "FullyShardedDataParallel: this module was wrapped by torch's own FSDP1, before "
                    "flatshard.install_as_torch_fsdp() (or FLATSHARD_AS_TORCH_FSDP=1) took effect; wrap the model "
                    "after the opt-in.") from None
            if name == WRAPPED or name == "_unit_state":
                raise
            if name == FLAT_PARAM and self._unit_state.handle is None:  # no parameters of its own: None, as torch
                return None
            try:
                return getattr(self._fsdp_wrapped_module, name)
            except AttributeError:
                raise missing_attribute(self, name) from None

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; inside ``summon_full_params`` without the wrappers' parts in names
        (as torch's FSDP1: outside it the names keep ``_fsdp_wrapped_module``)."""
        clean = self._unit_state.training_state is TrainingState.SUMMONING
        for name, p in nn.Module.named_parameters(self, *args, **kwargs):
            yield (clean_name(name) if clean else name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``, names cleaned inside ``summon_full_params`` only (as torch's)."""
        clean = self._unit_state.training_state is TrainingState.SUMMONING
        for name, b in nn.Module.named_buffers(self, *args, **kwargs):
            yield (clean_name(name) if clean else name), b

    def check_is_root(self) -> bool:
        """Whether this unit is the root (lazy-initializes if no forward ran yet)."""
        self._lazy_init()
        return bool(self._unit_state.is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FSDP unit in ``module`` (only the outermost ones with ``root_only``)."""
        return fsdp_modules(module, root_only)

    # ---------------------------------------------------- full parameters

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``fn`` on every submodule and then this one, as ``nn.Module.apply``, with full parameters.

        As torch's FSDP does: each unit's full parameters are summoned while
        ``fn`` runs over its modules and written back to the shards after
        (e.g. ``model.apply(init_weights)`` after wrapping). Collective.
        """
        return _full_params.apply(self, fn)

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Exposes the full, unsharded original parameters of ``module``'s units.

        Inside the context every original parameter is an ``nn.Parameter`` again
        under its own name and ``named_parameters()`` lists them instead of the
        flat shards. With ``writeback`` (default), changes made to them inside
        are copied back into the local shards on exit. Collective: every rank
        must enter. Refuses what torch's FSDP1 refuses, with its errors
        (``rank0_only`` with ``writeback``, ``offload_to_cpu`` with NO_SHARD,
        ``with_grads`` with ``use_orig_params=False`` or ``offload_to_cpu``);
        ``flatshard.summon_full_params`` does those too.
        """
        return _full_params.summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads,
                                               beyond_torch=False)

    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clips the gradient norm of every parameter, viewed as one vector, in place.

        Call it on the root, after backward. The norm combines the local
        gradient shards over the shard group (a collective: every rank must
        call it); a replicated unit's gradient (NO_SHARD), and ignored modules'
        gradients, count once. Returns the total norm (same on every rank).
        ``torch.nn.utils.clip_grad_norm_`` on ``model.parameters()`` would see
        only this rank's shards.
        """
        return _clip_grad_norm.clip_grad_norm(self, max_norm, norm_type)

    # ------------------------------------------------------------ state dicts

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The state dict of the type set by ``state_dict_type`` (FULL by default: full tensors under the
        original names, see [Note: State dicts]; SHARDED: ShardedTensors, or DTensors with a device_mesh; LOCAL:
        flat shards). Collective.

        Also called by a plain parent module's ``state_dict()`` (with its
        ``destination`` and ``prefix``): the entries go there.
        """
        return _state_dict.state_dict(self, args, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads a state dict of the type set by ``state_dict_type`` into every rank's shards (see
        [Note: State dicts]; a SHARDED one may come from another world size through DCP)."""
        return _state_dict.load_state_dict(self, state_dict, strict, assign)

    def _fqn_modifiers(self) -> dict[str, str]:
        """Called only by torch's ``torch.distributed.checkpoint.state_dict`` helpers, which would lose
        optimizer state on a flatshard model: raises with the fix (see [Note: torch's state-dict
        helpers] in ``checkpoint/_state_dict_api.py``)."""
        raise RuntimeError(TORCH_HELPERS_ERROR)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> StateDictSettings:
        """Sets the state dict type of every unit in ``module``; returns the previous settings (as torch).

        FULL_STATE_DICT (torch's default), SHARDED_STATE_DICT and LOCAL_STATE_DICT, with
        their configs as torch defines them (see [Note: Sharded state dicts] and [Note: Local
        state dicts] in ``_sharded_state_dict.py``).
        """
        return _state_dict.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state dict settings of the units in ``module``."""
        return _state_dict.get_state_dict_type(module)

    @staticmethod
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Within the context, the units of ``module`` use this state dict type and config."""
        return _state_dict.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

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
        and ``rank0_only`` (other ranks get ``{}``); under SHARDED_STATE_DICT (and
        LOCAL, as torch) each per-element state is cut as the parameter is (a ShardedTensor or a DTensor).
        """
        return _optim_state_dict.optim_state_dict(model, optim, optim_state_dict, group)

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
        return _optim_state_dict.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduces gradients with ``hook`` instead of flatshard's own reduction, for every unit.

        As torch's FSDP1 (see [Note: Communication hooks] in ``_comm_hooks.py``): call it on
        the root before training; torch's default hooks
        (``torch.distributed.algorithms._comm_hooks.default_hooks``) work.
        """
        _comm_hooks.register(self, state, hook)

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """torch's older name for a FULL ``optim_state_dict`` (see [Note: Older optimizer-state functions])."""
        return _optim_state_dict.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict every rank holds, ready for ``optim.load_state_dict``."""
        return _optim_state_dict.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """As ``shard_full_optim_state_dict``, with the full dict on rank 0 only (broadcast)."""
        return _optim_state_dict.scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim, group)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: Any,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Keys by original parameter name (``OptimStateKeyType.PARAM_NAME``) or by position in the
        unwrapped model's ``parameters()`` (``PARAM_ID``)."""
        return _optim_state_dict.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim_input,
                                                        optim)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """torch's older name for a SHARDED ``optim_state_dict`` (ShardedTensors; see [Note: Older
        optimizer-state functions])."""
        return _optim_state_dict.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """A ``sharded_optim_state_dict`` as this rank's state for ``optim.load_state_dict``."""
        return _optim_state_dict.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)
