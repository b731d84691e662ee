"""torch FSDP1's constructor arguments, resolved once into a unit's configuration.

The class (fully_sharded_data_parallel.py) calls ``resolve`` for the unit it is asked to
wrap; the units its auto-wrap policy makes get the same ``UnitConfig`` (or, with a
policy's overrides, ``resolve_overrides``'s copy). See [Note: Unit configuration] in
_config.py. Every message names the argument (torch's own messages, where tests match them,
come first and flatshard's fix after).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _mixed_precision
from flatshard._common import HYBRID, RESHARD_AFTER_FORWARD, is_unit
from flatshard._config import UnitConfig
from flatshard.api import BackwardPrefetch, CPUOffload, ShardingStrategy


# The constructor arguments a unit's configuration is resolved from (``auto_wrap_policy`` makes units; it is not
# configuration).
ARGUMENTS = ("process_group", "sharding_strategy", "cpu_offload", "backward_prefetch", "mixed_precision",
             "ignored_modules", "param_init_fn", "device_id", "sync_module_states", "forward_prefetch",
             "limit_all_gathers", "use_orig_params", "ignored_states", "device_mesh")


def resolve(module: nn.Module, arguments: Mapping[str, Any], *, ignored_params: Iterable[nn.Parameter] = (),
            device_mesh_given: bool = False) -> UnitConfig:
    """The configuration of the unit wrapping ``module``: ``arguments`` are the class's constructor arguments by
    name (the class's signature holds their defaults), validated here."""
    (process_group, sharding_strategy, cpu_offload, backward_prefetch, mixed_precision, ignored_modules,
     param_init_fn, device_id, sync_module_states, forward_prefetch, limit_all_gathers, use_orig_params,
     ignored_states, device_mesh) = (arguments[name] for name in ARGUMENTS)
    ignored_modules, extra_ignored = split_ignored_states(ignored_modules, ignored_states)
    strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
    if not isinstance(strategy, ShardingStrategy):
        raise ValueError(
            f"FullyShardedDataParallel: sharding_strategy: expected a ShardingStrategy but got "
            f"{sharding_strategy!r}"
        )
    if param_init_fn is not None and not callable(param_init_fn):  # (torch's message, then ours)
        raise ValueError(
            f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}: param_init_fn takes a module "
            f"and materializes its parameters."
        )
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise ValueError(
            f"FullyShardedDataParallel: backward_prefetch: expected a BackwardPrefetch or None "
            f"but got {backward_prefetch!r}"
        )
    shard_group, replicate_group = resolve_groups(process_group, device_mesh, strategy)
    world_size = dist.get_world_size(shard_group)
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    # Gradients are averaged over every data-parallel rank: divided before and after the SUM.
    predivide, postdivide = _mixed_precision.gradient_divide_factors(world_size * replicas)
    mixed_precision = _mixed_precision.check_mixed_precision(mixed_precision)
    offload_params = _mixed_precision.check_cpu_offload(cpu_offload)
    device_id = check_device_id(device_id)
    ignored = expand_ignored(ignored_modules, module)
    ignored_params = {p for m in ignored for p in m.parameters(recurse=False)} | extra_ignored | set(ignored_params)
    return UnitConfig(
        process_group=shard_group,
        replicate_group=replicate_group,
        rank=dist.get_rank(shard_group),
        world_size=world_size,
        sharding_strategy=strategy,
        shard_factor=1 if strategy == ShardingStrategy.NO_SHARD else world_size,
        reshard_after_forward=strategy in RESHARD_AFTER_FORWARD,
        predivide=predivide,
        postdivide=postdivide,
        backward_prefetch=backward_prefetch,
        forward_prefetch=bool(forward_prefetch),
        limit_all_gathers=bool(limit_all_gathers),
        mixed_precision=mixed_precision,
        offload_params=offload_params,
        use_orig_params=bool(use_orig_params),
        device_id=device_id,
        param_init_fn=param_init_fn,
        sync_module_states=bool(sync_module_states),
        device_mesh_given=device_mesh is not None or device_mesh_given,
        ignored_modules=frozenset(ignored),
        ignored_params=frozenset(ignored_params),
    )


def resolve_overrides(config: UnitConfig, module: nn.Module, overrides: dict[str, Any]) -> UnitConfig:
    """A unit's configuration under an auto-wrap policy's overrides (a ``CustomPolicy``'s dict): its
    parent's, resolved again with the overridden arguments; the parent's groups are reused, never remade."""
    if not overrides:
        return config
    inherited = dict(
        process_group=(config.process_group if config.replicate_group is None
                       else (config.process_group, config.replicate_group)),
        sharding_strategy=config.sharding_strategy,
        cpu_offload=CPUOffload(offload_params=config.offload_params),
        backward_prefetch=config.backward_prefetch,
        mixed_precision=config.mixed_precision,
        ignored_modules=config.ignored_modules,
        param_init_fn=config.param_init_fn,
        device_id=config.device_id,
        sync_module_states=config.sync_module_states,
        forward_prefetch=config.forward_prefetch,
        limit_all_gathers=config.limit_all_gathers,
        use_orig_params=config.use_orig_params,
        ignored_states=None,
        device_mesh=None,
    )
    unknown = sorted(set(overrides) - set(inherited))
    if unknown:  # (a TypeError, as Python's for an unexpected keyword argument)
        raise TypeError(
            f"FullyShardedDataParallel: auto_wrap_policy: the overrides for {type(module).__name__} name "
            f"{unknown}, which are not FullyShardedDataParallel arguments; return a dict of constructor "
            f"arguments (sharding_strategy=, mixed_precision=, ...) or True/False.")
    fixed = sorted(set(overrides) & {"ignored_states", "device_mesh"})
    if fixed:
        raise ValueError(
            f"FullyShardedDataParallel: auto_wrap_policy: the overrides for {type(module).__name__} name "
            f"{fixed}, which hold for the whole wrap: pass them to the outermost FullyShardedDataParallel.")
    return resolve(module, {**inherited, **overrides}, ignored_params=config.ignored_params,
                   device_mesh_given=config.device_mesh_given)


def resolve_groups(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group or None) from torch's process_group/device_mesh arguments."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel: expected an initialized default process group but "
            "torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "first (torchrun sets the environment it needs), or pass process_group=."
        )
    hybrid = strategy in HYBRID
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError(
                "FullyShardedDataParallel: expected process_group or device_mesh but got both; pass one."
            )
        if hybrid:
            if device_mesh.ndim != 2:
                raise ValueError(
                    f"FullyShardedDataParallel: {strategy}: expected a 2-D device_mesh (replicate, shard) "
                    f"but got {device_mesh.ndim} dimensions"
                )
            return device_mesh.get_group(mesh_dim=1), device_mesh.get_group(mesh_dim=0)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy}: expected a 1-D device_mesh but got "
                f"{device_mesh.ndim} dimensions; 2-D meshes are for HYBRID_SHARD"
            )
        return device_mesh.get_group(), None
    if isinstance(process_group, tuple):
        if not hybrid:
            raise ValueError(
                f"FullyShardedDataParallel: a (shard_group, replicate_group) process_group is for "
                f"HYBRID_SHARD or HYBRID_SHARD_ZERO2 but sharding_strategy is {strategy}; pass one group."
            )
        if len(process_group) != 2:
            raise ValueError(
                f"FullyShardedDataParallel: process_group: expected (shard_group, replicate_group) but got "
                f"a tuple of {len(process_group)}"
            )
        return process_group[0], process_group[1]
    if hybrid:
        if process_group is not None:
            raise ValueError(
                f"FullyShardedDataParallel: {strategy} needs a (shard_group, replicate_group) tuple or a "
                f"2-D device_mesh, not one process group; or pass neither to shard within each host."
            )
        return per_host_groups()
    return (process_group if process_group is not None else dist.group.WORLD), None


def per_host_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Hybrid default: shard within each host, replicate across hosts (every rank builds every group)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (
        torch.cuda.device_count() if torch.cuda.is_available() else world
    )
    if local < 1 or world % local:
        raise ValueError(
            f"FullyShardedDataParallel: hybrid sharding per host: expected the world size {world} to be a "
            f"multiple of the ranks per host ({local}); pass process_group=(shard_group, replicate_group)."
        )
    shard = replicate = None
    for start in range(0, world, local):
        group = dist.new_group(list(range(start, start + local)))
        if start <= rank < start + local:
            shard = group
    for offset in range(local):
        group = dist.new_group(list(range(offset, world, local)))
        if rank % local == offset:
            replicate = group
    return shard, replicate


def check_device_id(device_id: int | str | torch.device | None) -> torch.device | None:
    """torch's ``device_id`` as a device (an index means a CUDA device), or None."""
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if isinstance(device_id, str):  # "cpu", "cuda", "cuda:1", as torch accepts
        try:
            device_id = torch.device(device_id)
        except RuntimeError as e:
            raise ValueError(f"FullyShardedDataParallel: device_id: {device_id!r} is not a device: {e}") from None
    if isinstance(device_id, torch.device):
        if device_id.type == "cuda" and device_id.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device_id
    raise ValueError(
        f"FullyShardedDataParallel: device_id: expected an int, a str, a torch.device or None but got "
        f"{device_id!r}"
    )


def split_ignored_states(
    ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[Any] | None
) -> tuple[Iterable[nn.Module] | None, set[nn.Parameter]]:
    """torch's ``ignored_states``: all parameters (ignored one by one) or all modules (as
    ``ignored_modules``). Returns (ignored modules, ignored parameters)."""
    if ignored_states is None:
        return ignored_modules, set()
    if ignored_modules is not None:  # (torch's message)
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just pass ignored_states."
        )
    states = list(ignored_states)
    if all(isinstance(s, nn.Parameter) for s in states):
        return None, set(states)
    if all(isinstance(s, nn.Module) for s in states):
        return states, set()
    raise ValueError(
        f"ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        f"{sorted({type(s) for s in states}, key=repr)}"
    )


def expand_ignored(ignored_modules: Iterable[nn.Module] | None, root: nn.Module) -> set[nn.Module]:
    if ignored_modules is None:
        return set()
    out: set[nn.Module] = set()
    ignored_modules = list(ignored_modules)
    if not all(isinstance(m, nn.Module) for m in ignored_modules):  # (torch's message)
        raise ValueError(f"ignored_modules expects nn.Module list elements but got types "
                         f"{sorted({type(m) for m in ignored_modules}, key=repr)}")
    for m in ignored_modules:
        if is_unit(m):
            raise ValueError("`ignored_modules` should not include FSDP modules: pass the plain modules to ignore.")
        out.update(m.modules())
    if root in out:
        # As torch: allowed, with a warning; the unit then owns no parameter (nothing is sharded).
        warnings.warn(
            f"Trying to ignore the top-level module passed into the FSDP constructor itself will result in all "
            f"parameters being ignored and is not well-supported: {type(root).__name__}. Every parameter of it is "
            f"left unsharded on every rank, as plain module state: ignore its submodules instead, or do not wrap it.",
            stacklevel=4,  # (the user's FSDP(...) call: __init__, resolve, here)
        )
    return out
