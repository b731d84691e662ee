"""Model state dicts: ``state_dict``, ``load_state_dict`` and the state dict type settings.

[Note: State dicts]
StateDictType.FULL_STATE_DICT, torch's default: state_dict() gathers the
full parameters (a collective: every rank calls it) and returns them
under the original module's names, as a plain model's state_dict() would
(tied parameters under each of their names); FullStateDictConfig's
offload_to_cpu and rank0_only are honoured. load_state_dict() takes such
a dict and writes every rank's shards. Nested units called from their
root's state_dict() (inside summon_full_params) behave as plain modules.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _rank_guard
from flatshard._common import check_between_iterations, clean_name, fsdp_modules
from flatshard._full_params import summon_full_params
from flatshard._mixed_precision import original_buffer_dtypes
from flatshard._sharded_state_dict import load_per_unit, prepare_local_load, sharded_or_local_state_dict
from flatshard.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictSettings,
    StateDictType,
)


def state_dict(unit: Any, args: tuple, destination: Any, prefix: str, keep_vars: bool) -> Any:
    """See ``FullyShardedDataParallel.state_dict``."""
    if unit._in_summon or unit.__dict__.get("_plain_state_dict"):
        return nn.Module.state_dict(unit, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
    if args:
        raise ValueError(
            "FullyShardedDataParallel.state_dict: positional arguments are not supported; pass "
            "destination=, prefix= and keep_vars= by name."
        )
    if unit._state_dict_type != StateDictType.FULL_STATE_DICT:
        return sharded_or_local_state_dict(unit, destination, prefix)
    config = unit._state_dict_config
    out = destination if destination is not None else collections.OrderedDict()
    keep = not config.rank0_only or dist.get_rank() == 0
    with summon_full_params(unit, writeback=False, guard_phase="state_dict()"):  # (also the lazy init,
        # which casts buffers)
        buffer_dtypes = original_buffer_dtypes(unit)  # saved as they were before buffer_dtype
        summoned = {id(m._parameters[attr]) for u in fsdp_modules(unit) if u._handle is not None
                    for m, attr, _ in u._param_slots if m._parameters.get(attr) is not None}
        full = nn.Module.state_dict(unit, prefix=prefix, keep_vars=True)
        if keep:
            for name, value in full.items():
                if isinstance(value, torch.Tensor):
                    if id(value) in summoned:
                        # Cloned: the summoned storage is freed on exit.
                        value = value.detach().clone()
                    else:
                        # Buffers and ignored parameters: the tensors themselves (as torch), in
                        # their original dtype.
                        dtype = buffer_dtypes.get(id(value), value.dtype)
                        value = value.detach().to(dtype)
                    if config.offload_to_cpu:
                        value = value.cpu()
                out[clean_name(name)] = value
    return out


def load_state_dict(unit: Any, state_dict: Any, strict: bool, assign: bool) -> Any:
    """See ``FullyShardedDataParallel.load_state_dict``."""
    if assign and not unit._in_summon:
        raise NotImplementedError(
            "FullyShardedDataParallel.load_state_dict: assign=True is not implemented in flatshard; "
            "load with assign=False (values are copied into the shards)."
        )
    result = nn.Module.load_state_dict(unit, state_dict, strict=strict, assign=assign)
    return type(result)(
        [clean_name(k) for k in result.missing_keys], [clean_name(k) for k in result.unexpected_keys]
    )


def register_load_hooks(unit: Any) -> None:
    """Hooks that let a plain parent's ``load_state_dict()`` load into the unit too."""
    unit._register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict, unit))
    unit.register_load_state_dict_post_hook(_post_load_state_dict)


def _pre_load_state_dict(unit: Any, state_dict: Any, prefix: str, *args: Any) -> None:
    # Runs before this module loads, also under a plain parent's load_state_dict(): the
    # outermost unit loads every unit's parameters, one unit at a time, and hands the rest
    # (buffers, ignored parameters) to nn.Module under the wrapped names.
    if unit._in_summon or unit.__dict__.pop("_loaded_by_outer_unit", False):
        return
    if unit._is_root is None:
        unit._lazy_init()
    check_between_iterations(unit, "FullyShardedDataParallel.load_state_dict")
    _rank_guard.check(unit, "load_state_dict()")
    if unit._state_dict_type == StateDictType.LOCAL_STATE_DICT:
        # Loads the shards as they are: no summon.
        unit.__dict__["_load_missing"] = prepare_local_load(unit, state_dict, prefix)
    else:
        # FULL and SHARDED (DTensors) alike: one unit at a time (see load_per_unit).
        unit.__dict__["_load_missing"] = load_per_unit(unit, state_dict, prefix)
    for inner in fsdp_modules(unit):  # their own pre-load hooks, which run next, have nothing left to do
        if inner is not unit:
            inner.__dict__["_loaded_by_outer_unit"] = True


def _post_load_state_dict(unit: nn.Module, incompatible_keys: Any) -> None:
    # The parameters' keys the state dict lacked (nn.Module saw the flat parameter's in their place).
    incompatible_keys.missing_keys.extend(unit.__dict__.pop("_load_missing", []))


_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def set_state_dict_type(
    module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any, optim_state_dict_config: Any
) -> StateDictSettings:
    """See ``FullyShardedDataParallel.set_state_dict_type``."""
    if state_dict_type not in _CONFIGS:
        raise NotImplementedError(
            f"FullyShardedDataParallel.set_state_dict_type: {state_dict_type} is not implemented in "
            f"flatshard yet; use StateDictType.FULL_STATE_DICT or SHARDED_STATE_DICT."
        )
    configs = []
    for config, cls in zip((state_dict_config, optim_state_dict_config), _CONFIGS[state_dict_type]):
        config = cls() if config is None else config
        if not isinstance(config, cls):
            raise ValueError(
                f"FullyShardedDataParallel.set_state_dict_type: expected a {cls.__name__} for "
                f"{state_dict_type.name} but got {config!r}"
            )
        configs.append(config)
    state_dict_config, optim_state_dict_config = configs
    units = fsdp_modules(module)
    if not units:
        raise ValueError("set_state_dict_type: expected a module with FSDP units but found none")
    previous = get_state_dict_type(module)
    for unit in units:
        unit._state_dict_type = state_dict_type
        unit._state_dict_config = state_dict_config
        unit._optim_state_dict_config = optim_state_dict_config
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """See ``FullyShardedDataParallel.get_state_dict_type``."""
    units = fsdp_modules(module)
    if not units:
        raise ValueError("get_state_dict_type: expected a module with FSDP units but found none")
    unit = units[0]
    return StateDictSettings(unit._state_dict_type, unit._state_dict_config, unit._optim_state_dict_config)


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any, optim_state_dict_config: Any
) -> Iterator[None]:
    """See ``FullyShardedDataParallel.state_dict_type``."""
    previous = set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        set_state_dict_type(
            module, previous.state_dict_type, previous.state_dict_config, previous.optim_state_dict_config
        )
