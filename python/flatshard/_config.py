"""A unit's configuration: what a front-end resolves once and the runtime only reads.

[Note: Unit configuration]
A front-end turns its arguments into one frozen ``UnitConfig`` (the class: torch FSDP1's
constructor arguments, in _fsdp1_config.py) and hands it, with the modules, to the
construction (_construction.py); every unit keeps it as ``UnitState.config``. Nothing
changes it after wrap time, and the runtime never writes it: the groups are made, the
strategy, prefetch, dtypes and offload validated, once per wrap call. The units an
auto-wrap policy makes share their parent's object; a policy that overrides an argument
for one module (a ``CustomPolicy`` returning a dict) gives that unit a copy resolved
again with the override (the parent's groups reused, unless it overrides those).

Where a unit's storage lives (``UnitState.device``) is not configuration: with
``device_id`` it is that device, else it follows the unit's own modules (or the device
``param_init_fn`` materialized them on), so it is decided unit by unit at construction.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from flatshard.api import BackwardPrefetch, MixedPrecision, ShardingStrategy

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclasses.dataclass(frozen=True, eq=False)
class UnitConfig:
    """How a unit shards, communicates and computes (see [Note: Unit configuration])."""

    # --- groups
    process_group: dist.ProcessGroup  # the shard group
    replicate_group: dist.ProcessGroup | None  # hybrid sharding's replicate group, else None
    rank: int  # this rank in the shard group
    world_size: int  # the shard group's size
    # --- strategy
    sharding_strategy: ShardingStrategy
    shard_factor: int  # ranks the flat parameter is split over (1: NO_SHARD)
    reshard_after_forward: bool  # FULL_SHARD, HYBRID_SHARD
    predivide: float  # gradient division before the SUM (see _mixed_precision.gradient_divide_factors)
    postdivide: float  # and after it
    # --- scheduling
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    # --- dtypes and placement
    mixed_precision: MixedPrecision | None  # torch's MixedPrecision, or None
    offload_params: bool  # the shards live in host memory (CPUOffload(offload_params=True))
    use_orig_params: bool
    device_id: torch.device | None  # the device the unit computes on, or None: it follows its modules
    # --- construction
    param_init_fn: Callable[[nn.Module], None] | None
    sync_module_states: bool
    device_mesh_given: bool  # built from a device_mesh: SHARDED state dicts hold DTensors (else ShardedTensors)
    ignored_modules: frozenset[nn.Module]  # the expanded set
    ignored_params: frozenset[nn.Parameter]
    # --- fully_shard's (the class leaves the defaults)
    dim0_layout: bool = False  # FSDP2's layout and DTensor parameters (see [Note: DTensor parameters])
    mesh: Any = None  # the DeviceMesh the DTensor parameters are placed on
    # fully_shard's shard_placement_fn resolved by its front-end: (parameters, their names, shard factor) -> each
    # one's shard dim (see [Note: Sharding on another dim] in csrc/flatshard/layout.h), asked at construction;
    # None: dim 0 for every parameter
    shard_dims_of: Callable[[list[nn.Parameter], list[str], int], list[int]] | None = None
    meta_to_empty: bool = False  # a meta-device module's tensors become uninitialized memory (users init later)
    output_dtype: torch.dtype | None = None  # the forward's floating-point outputs cast to it (fully_shard's hook)
    root_reshards_after_forward: bool = False  # as root too (fully_shard's explicit reshard_after_forward=True)
    reshard_after_no_grad_forward: bool = True  # every unit, root included (fully_shard: only as after any forward)
    pin_host_memory: bool = True  # with offload_params: pinned host memory (CPUOffloadPolicy(pin_memory=False): not)
    # reshard_after_forward as an int N: the group of N ranks the unit reshards to after forward (see [Note: Reshard
    # to a smaller group] in csrc/flatshard/flat_param.h); None: it reshards to its shard, or not at all
    post_forward_group: dist.ProcessGroup | None = None
    # The unsharded parameters registered on the modules while the unit is unsharded (torch FSDP2's: parameters()
    # in forward yields them, e.g. HF's `self.dtype` reads param_dtype), not only shadowing the registered ones
    registers_unsharded: bool = False
    # fully_shard's dp_mesh_dims: the full SPMD mesh the parameters are DTensors on, and the indices of its
    # data-parallel dims (``mesh`` is their submesh); see [Note: torch's SPMD path] in _fsdp2_config.py
    spmd: tuple[Any, frozenset[int]] | None = None
    # fully_shard's set_gradient_divide_factor and set_force_sum_reduction_for_comms (predivide and postdivide follow)
    gradient_divide_factor: float | None = None
    force_sum_reduction: bool = False
    # whether torch's FSDP2 divides inside its collectives here (fp32 and bf16, summing not forced): where fully_shard's
    # all-reduce hook sees the shard (see [Note: The all-reduce hook] in csrc/flatshard/flat_param.h)
    divides_in_collectives: bool = True
    # A prefetch gathers the units after its own together with it, in one collective, while their unsharded bytes
    # sum to at most this (0: never; the root's value holds for its units): see [Note: Small units gathered
    # together] in csrc/flatshard/scheduler.h
    gather_together_bytes: int = 0
