"""Model state dicts: ``state_dict``, ``load_state_dict`` and the state dict type settings.

[Note: State dicts]
StateDictType.FULL_STATE_DICT, torch's default: state_dict() gathers the
full parameters (a collective: every rank calls it) and returns them
under the original module's names, as a plain model's state_dict() would
(tied parameters under each of their names); FullStateDictConfig's
offload_to_cpu and rank0_only are honoured. load_state_dict() takes such
a dict and writes every rank's shards (see [Note: Loading state dicts] in
_state_dict_load.py). Nested units called from their root's state_dict()
(inside summon_full_params) behave as plain modules.
"""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard._common import clean_name, fsdp_modules
from flatshard._full_params import summon_full_params
from flatshard._mixed_precision import original_buffer_dtypes
from flatshard._sharded_state_dict import sharded_or_local_state_dict
from flatshard._state import TrainingState
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

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel


def state_dict(unit: FullyShardedDataParallel, args: tuple, destination: Any, prefix: str, keep_vars: bool) -> Any:
    """See ``FullyShardedDataParallel.state_dict``."""
    state = unit._unit_state
    if state.plain_state_dict:
        return nn.Module.state_dict(unit, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
    if state.training_state is TrainingState.SUMMONING:  # the full parameters as they are, under clean names
        return _summoned_state_dict(unit, args, destination, prefix, keep_vars)
    if args:
        raise ValueError(
            "FullyShardedDataParallel.state_dict: positional arguments are not supported; pass "
            "destination=, prefix= and keep_vars= by name."
        )
    if state.state_dict_type != StateDictType.FULL_STATE_DICT:
        return sharded_or_local_state_dict(unit, destination, prefix)
    config = state.state_dict_config
    out = destination if destination is not None else collections.OrderedDict()
    keep = not config.rank0_only or dist.get_rank() == 0
    with summon_full_params(unit, writeback=False, guard_phase="state_dict()"):  # (also the lazy init,
        # which casts buffers)
        buffer_dtypes = original_buffer_dtypes(unit)  # saved as they were before buffer_dtype
        summoned = {id(m._parameters[attr]) for u in fsdp_modules(unit) if u._unit_state.handle is not None
                    for m, attr, _ in u._unit_state.param_slots if m._parameters.get(attr) is not None}
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


def load_state_dict(unit: FullyShardedDataParallel, state_dict: Any, strict: bool, assign: bool) -> Any:
    """See ``FullyShardedDataParallel.load_state_dict``."""
    if assign and unit._unit_state.training_state is not TrainingState.SUMMONING:
        raise NotImplementedError(
            "FullyShardedDataParallel.load_state_dict: assign=True is not implemented in flatshard; "
            "load with assign=False (values are copied into the shards)."
        )
    result = nn.Module.load_state_dict(unit, state_dict, strict=strict, assign=assign)
    return type(result)(
        [clean_name(k) for k in result.missing_keys], [clean_name(k) for k in result.unexpected_keys]
    )


def _summoned_state_dict(unit: FullyShardedDataParallel, args: tuple, destination: Any, prefix: str,
                         keep_vars: bool) -> Any:
    """Inside ``summon_full_params``: ``nn.Module``'s state dict of the full parameters, with the wrappers' parts
    taken out of the keys this unit adds (as torch's FSDP1; peft's and verl's LoRA export read these keys)."""
    out = destination if destination is not None else collections.OrderedDict()
    before = len(out)
    nn.Module.state_dict(unit, *args, destination=out, prefix=prefix, keep_vars=keep_vars)
    added = list(out.items())[before:]
    for key, _ in added:
        del out[key]
    for key, value in added:
        out[prefix + clean_name(key[len(prefix):])] = value
    return out


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
        if not isinstance(config, cls):  # (torch's type and phrase)
            raise RuntimeError(
                f"Expected {'optim_' if configs else ''}state_dict_config of type {cls} but got {type(config)} "
                f"(FullyShardedDataParallel.set_state_dict_type: {state_dict_type.name} takes a {cls.__name__})"
            )
        configs.append(config)
    state_dict_config, optim_state_dict_config = configs
    units = fsdp_modules(module)
    if not units:
        raise ValueError("set_state_dict_type: expected a module with FSDP units but found none")
    previous = get_state_dict_type(module)
    for unit in units:
        state = unit._unit_state
        state.state_dict_type = state_dict_type
        state.state_dict_config = state_dict_config
        state.optim_state_dict_config = optim_state_dict_config
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """See ``FullyShardedDataParallel.get_state_dict_type``."""
    units = fsdp_modules(module)
    if not units:
        raise ValueError("get_state_dict_type: expected a module with FSDP units but found none")
    unit = units[0]
    state = unit._unit_state
    return StateDictSettings(state.state_dict_type, state.state_dict_config, state.optim_state_dict_config)


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
