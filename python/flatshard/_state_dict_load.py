"""Loading model state dicts of all three types into the shards.

[Note: Loading state dicts]
``load_state_dict`` is ``nn.Module``'s, with a pre-load hook on every unit (so that a
plain parent's ``load_state_dict()`` loads into the units too). The outermost unit's hook
does the work for every unit below it, and marks them so that their own hooks, which run
next, do nothing:
- FULL and SHARDED: one unit at a time (``load_per_unit``), the unit's entries become full
  values (DTensors and ShardedTensors gathered), are copied into its summoned parameters
  and written back to the shards, then dropped: the extra memory is one unit's.
- LOCAL: each unit's flat shard is checked against its layout record and copied in place
  (``prepare_local_load``); nothing is gathered.
Either way, each loaded unit's entries are replaced by its registered parameters
themselves (which ``nn.Module`` then copies onto themselves), the keys the dict lacked
are recorded and reported by the post-load hook under their clean names, and the rest
(buffers, ignored parameters) is renamed to the wrapped names ``nn.Module`` looks for.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from flatshard import _rank_guard
from flatshard._common import (
    FLAT_PARAM,
    check_between_iterations,
    clean_name,
    fsdp_modules,
    join,
    without_checkpoint_wrappers,
)
from flatshard._full_params import summon_full_params
from flatshard._runtime import lazy_init
from flatshard._sharded_state_dict import (LAYOUT_METADATA, LAYOUT_SUFFIX, layout_record, local_dtensor,
                                          metadata_key, to_full)
from flatshard._state import TrainingState
from flatshard.api import StateDictType

if TYPE_CHECKING:
    from flatshard.fully_sharded_data_parallel import FullyShardedDataParallel


def register_load_hooks(unit: FullyShardedDataParallel) -> None:
    """Hooks that let a plain parent's ``load_state_dict()`` load into the unit too."""
    unit._register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict, unit))
    unit.register_load_state_dict_post_hook(_post_load_state_dict)


def _pre_load_state_dict(unit: FullyShardedDataParallel, state_dict: Any, prefix: str, *args: Any) -> None:
    # Runs before this module loads, also under a plain parent's load_state_dict(): the
    # outermost unit loads every unit's parameters, one unit at a time, and hands the rest
    # (buffers, ignored parameters) to nn.Module under the wrapped names.
    s = unit._unit_state
    if s.training_state is TrainingState.SUMMONING or s.loading.pop("done", False):
        return
    if s.is_root is None:
        lazy_init(unit)
    check_between_iterations(unit, "FullyShardedDataParallel.load_state_dict")
    _rank_guard.check(s.root, "load_state_dict()")
    if s.state_dict_type == StateDictType.LOCAL_STATE_DICT:
        # Loads the shards as they are: no summon.
        s.loading["missing"] = prepare_local_load(unit, state_dict, prefix)
    else:
        # FULL and SHARDED (ShardedTensors, DTensors) alike: one unit at a time (see load_per_unit).
        s.loading["missing"] = load_per_unit(unit, state_dict, prefix)
    for inner in fsdp_modules(unit):  # their own pre-load hooks, which run next, have nothing left to do
        if inner is not unit:
            inner._unit_state.loading["done"] = True


def _post_load_state_dict(unit: FullyShardedDataParallel, incompatible_keys: Any) -> None:
    # The parameters' keys the state dict lacked (nn.Module saw the flat parameter's in their place).
    incompatible_keys.missing_keys.extend(unit._unit_state.loading.pop("missing", []))


def prepare_local_load(unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """Before ``load_state_dict`` of a LOCAL_STATE_DICT: checks each unit's layout record and
    copies its shard in place, then leaves the (renamed) rest to ``nn.Module``'s loading.
    Returns the flat parameters' keys the state dict lacks."""
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    missing: list[str] = []
    for u in fsdp_modules(unit):
        if u._unit_state.handle is None:
            continue
        name = prefix + join(paths[id(u)], FLAT_PARAM)
        value = state_dict.get(name)
        record = state_dict.pop(prefix + join(paths[id(u)], LAYOUT_SUFFIX), None)  # (an older flatshard's)
        if record is None:  # see [Note: Local state dicts]
            record = (getattr(state_dict, "_metadata", None) or {}).get(metadata_key(prefix, paths[id(u)]),
                                                                        {}).get(LAYOUT_METADATA)
        if value is u._unit_state.flat_param:  # done by an outer unit
            continue
        if value is None:
            missing.append(name)
            _hand_registered_to_nn_module(u, state_dict, prefix, paths)
            continue
        where = f"unit '{u._unit_state.label}'"
        mine = layout_record(u._unit_state)
        if record is not None and record != mine:
            diff = ", ".join(f"{k}: {record.get(k)} != {mine[k]}" for k in mine if record.get(k) != mine[k])
            raise ValueError(
                f"FullyShardedDataParallel.load_state_dict: the LOCAL_STATE_DICT for {where} was saved with "
                f"another layout ({diff[:400]}); a local state dict loads only into the same wrapping. Save "
                f"with SHARDED_STATE_DICT to change the model or its wrapping."
            )
        expected = local_dtensor(u, offload_to_cpu=False)
        if isinstance(value, (DTensor, ShardedTensor)):
            if value.shape != expected.shape:
                raise ValueError(f"FullyShardedDataParallel.load_state_dict: {name} has {value.numel()} elements "
                                 f"but {where} holds {expected.numel()}; a local state dict loads only into the "
                                 f"same wrapping.")
            if isinstance(value, DTensor):
                value = value.to_local()
            else:  # this rank's one shard, or none (the ranks past the unpadded length)
                shards = value.local_shards()
                value = shards[0].tensor if shards else expected.to_local().new_empty(0)
        if not isinstance(value, torch.Tensor) or value.shape != expected.to_local().shape:
            raise ValueError(
                f"FullyShardedDataParallel.load_state_dict: {name} should be this rank's shard of "
                f"{tuple(expected.to_local().shape)} for {where} but is "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}; load a "
                f"LOCAL_STATE_DICT at the world size it was saved at, or through torch.distributed.checkpoint "
                f"(which reshards)."
            )
        with torch.no_grad():
            u._unit_state.flat_param.detach()[: value.numel()].copy_(value)
        del state_dict[name]
        _hand_registered_to_nn_module(u, state_dict, prefix, paths)
    rename_to_wrapped(unit, state_dict, prefix)
    return missing


def load_per_unit(unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str) -> list[str]:
    """Before ``load_state_dict`` of a FULL or SHARDED state dict: one unit at a time, takes its entries'
    full values (gathering DTensors) and copies them into its summoned parameters, so that the extra
    memory is one unit's (see [Note: Sharded state dicts]); leaves the (renamed) rest to
    ``nn.Module``'s loading. Returns the parameters' keys the state dict lacks. Collective."""
    paths = {id(m): clean_name(path) for path, m in unit.named_modules()}
    missing: list[str] = []
    for u in fsdp_modules(unit):
        if u._unit_state.handle is None:
            continue
        keys = [prefix + join(paths[id(m)], attr) for m, attr, _ in u._unit_state.param_slots]
        missing += [k for k in keys if k not in state_dict]
        full = to_full({k: state_dict[k] for k in keys if k in state_dict})  # same keys on every rank
        with summon_full_params(u, recurse=False, writeback=True, guard_phase=None), torch.no_grad():
            for (m, attr, _), key in zip(u._unit_state.param_slots, keys):
                if key not in full:
                    continue
                param, value = m._parameters[attr], full[key]
                # (Tensor-likes too: Lightning loads full checkpoints lazily, as tensors read when first used.)
                if not hasattr(value, "shape") or tuple(value.shape) != tuple(param.shape):
                    raise RuntimeError(
                        f"Error(s) in loading state_dict for {type(unit).__name__}: size mismatch for {key}: "
                        f"copying a param with shape {tuple(getattr(value, 'shape', ()))} from checkpoint, the "
                        f"shape in current model is {tuple(param.shape)}.")
                param.copy_(value)
        del full
        for key in keys:
            state_dict.pop(key, None)
        _hand_registered_to_nn_module(u, state_dict, prefix, paths)
    rename_to_wrapped(unit, state_dict, prefix)
    return missing


def _hand_registered_to_nn_module(unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str,
                                  paths: dict[int, str]) -> None:
    """After ``unit`` is loaded (or found missing, and reported as such): its registered parameters go into
    ``state_dict`` as themselves, so that ``nn.Module``'s loading copies them onto themselves and reports
    nothing for them (the original parameters with ``use_orig_params``, else the flat parameter)."""
    if unit._unit_state.config.use_orig_params:
        for m, attr, _ in unit._unit_state.param_slots:
            state_dict[prefix + join(paths[id(m)], attr)] = m._parameters[attr]
    else:
        state_dict[prefix + join(paths[id(unit)], FLAT_PARAM)] = unit._unit_state.flat_param


def rename_to_wrapped(unit: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str) -> None:
    """Entries under the original names to the names ``nn.Module``'s loading looks for: with the units'
    ``_fsdp_wrapped_module`` parts (an activation-checkpoint wrapper's pre-load hook adds its own)."""
    for actual, _ in [*nn.Module.named_parameters(unit, remove_duplicate=False),
                      *nn.Module.named_buffers(unit, remove_duplicate=False)]:
        clean, wanted = clean_name(actual), without_checkpoint_wrappers(actual)
        if clean != wanted and prefix + clean in state_dict and prefix + wanted not in state_dict:
            state_dict[prefix + wanted] = state_dict.pop(prefix + clean)
