"""Names and small helpers that every part of ``FullyShardedDataParallel`` shares."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from flatshard.api import ShardingStrategy

logger = logging.getLogger("flatshard")

WRAPPED = "_fsdp_wrapped_module"
# torch's activation-checkpoint wrapper's child (torch.distributed.algorithms._checkpoint).
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
FLAT_PARAM = "_flat_param"
# Set on an original parameter once a unit owns it: (unit name, parameter name).
OWNER_ATTR = "_flatshard_owner"

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class UsageError(RuntimeError, AssertionError):
    """A call at the wrong time (e.g. summoning parameters during forward or backward).

    A RuntimeError like our other misuse errors, and an AssertionError too, which is what
    torch's FSDP1 raises for the same calls, so that code catching either works.
    """


def clean_name(name: str) -> str:
    """A name without the wrappers' parts (``_fsdp_wrapped_module``, and the activation-checkpoint
    wrapper's ``_checkpoint_wrapped_module``, as torch's FSDP1 cleans them): the original module's.

    Component by component: the path of a wrapped module itself ends in the wrapper's
    name (``lin._fsdp_wrapped_module``), and its parameters' keys are that path's.
    """
    if WRAPPED not in name and CHECKPOINT_WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != WRAPPED and part != CHECKPOINT_WRAPPED)


def without_checkpoint_wrappers(name: str) -> str:
    """``name`` without the activation-checkpoint wrapper's parts only: the key ``nn.Module``'s loading
    must see, since each checkpoint wrapper's own pre-load hook puts its part back in."""
    if CHECKPOINT_WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != CHECKPOINT_WRAPPED)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_unit(module: Any) -> bool:
    """Whether ``module`` is a flatshard ``FullyShardedDataParallel`` (without importing the class)."""
    return getattr(type(module), "_is_flatshard_unit", False)


def fsdp_modules(module: nn.Module, root_only: bool = False) -> list:
    """Every unit of the class (FSDP1) in ``module`` (only the outermost ones with ``root_only``): fully_shard's
    units are not FSDP1 modules, as torch's ``FSDP.fsdp_modules`` does not list FSDP2's either, so what serves
    the class (its state dict helpers, summoning, moving shards) leaves them to torch's DTensor paths."""
    units = [m for m in module.modules() if is_unit(m) and not m._unit_state.config.dim0_layout]
    if root_only:
        inner = {id(m) for u in units for m in u.modules() if m is not u}
        units = [u for u in units if id(u) not in inner]
    return units


def fully_shard_units(module: nn.Module) -> list:
    """Every unit ``flatshard.fully_shard`` made in ``module``."""
    return [m for m in module.modules() if is_unit(m) and m._unit_state.config.dim0_layout]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def check_between_iterations(module: nn.Module, what: str) -> None:
    """Raises UsageError if a forward or backward of ``module``'s units is under way: ``what`` (a
    collective of its own) would interleave with the step's collectives and train wrong."""
    roots = [u._unit_state.root for u in fsdp_modules(module)]
    if in_backward() or any(r is not None and r.in_forward_call for r in roots):
        raise UsageError(f"{what}: called during forward or backward; call it between iterations.")


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from tensors_in(getattr(obj, f))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it: through lists, tuples, named tuples,
    dicts, sets and dataclasses; anything else is returned as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, (list, tuple, set)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, collections.OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            out[k] = map_tensors(fn, v)
        return out
    if isinstance(obj, dict):  # other mappings come back as plain dicts, as torch's FSDP returns them
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=True) if t.device != device else t, obj)
