"""torch FSDP2's ``fully_shard`` arguments, resolved once into a unit's configuration.

``flatshard.fully_shard`` calls ``resolve`` for each module it shards; see [Note: Unit configuration] in
_config.py. What this first version of the front-end does not support raises NotImplementedError naming the
argument (see [Note: fully_shard's coverage] in fully_shard.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from flatshard import _tensor_parallel
from flatshard._common import OWNER_ATTR
from flatshard._config import UnitConfig
from flatshard._mixed_precision import gradient_divide_factors
from flatshard.api import BackwardPrefetch, MixedPrecision, ShardingStrategy


def default_mesh() -> Any:
    """torch's default: a 1-D mesh over every rank, on the CUDA device where there is one, else the CPU; as torch's,
    the default process group is initialized first if it is not (from torchrun's environment: env://)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


# [Note: Forward prefetch where the host is the device]
# torch's FSDP2 issues a unit's all-gather at that unit's pre-forward; on a GPU its forward still overlaps each
# all-gather with the previous unit's compute, because the host runs ahead of the device: unit i+1's pre-forward
# issues its all-gather while unit i's kernels run, so unit i+1's gathered parameters exist while unit i computes.
# On the CPU the host is the device and nothing runs ahead: each all-gather would be waited for in full, with
# nothing to overlap it. So on a CPU mesh fully_shard prefetches in forward: each unit's pre-forward, after waiting
# for its own all-gather, issues the one of the unit that came next in the previous iteration (the class's
# forward_prefetch), which holds what FSDP2 holds on a GPU: the unit computing and the next one. On a GPU mesh it
# does not (the host's run-ahead already gives that overlap). ``set_modules_to_forward_prefetch`` replaces it, as
# it replaces torch's implicit order; an empty list turns it off.


# [Note: fully_shard gathers small units together]
# torch's FSDP2 issues one all-gather per unit, so a model of many small units (a block per layer of a narrow model,
# each norm or embedding a unit of its own) waits one collective latency per unit, twice per step, whatever the
# bytes. fully_shard's implicit prefetch (forward on a CPU mesh, backward everywhere) takes the units that run next
# along in the prefetched one's collective while their unsharded parameters come to at most
# GATHER_TOGETHER_BYTES in all ([Note: Gathering small units together] in _prefetch.py): what users see is unchanged
# (the same parameters, gradients and order of reductions; each unit still reshards after its own forward and
# backward), and what is held unsharded grows by at most that many bytes, a fraction of one unit of any model big
# enough to shard. The environment variable FLATSHARD_GATHER_TOGETHER_BYTES sets it for the units fully_shard makes
# afterwards (0: one all-gather per unit, as torch's). Its default is on for CPU meshes only, for now: on a GPU the
# coalesced all-gather is NCCL's grouped one, which has not run on a GPU yet (issue 28's next session); there the
# variable turns it on.
GATHER_TOGETHER_BYTES = 256 * 1024


def gather_together_bytes(device_type: str = "cpu") -> int:
    """See [Note: fully_shard gathers small units together]."""
    text = os.environ.get("FLATSHARD_GATHER_TOGETHER_BYTES")
    if text is None:
        return GATHER_TOGETHER_BYTES if device_type == "cpu" else 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"FLATSHARD_GATHER_TOGETHER_BYTES={text!r}: expected a number of bytes, 0 or more (0: one "
                         f"all-gather per unit); it is how many unsharded bytes of small units fully_shard gathers "
                         f"in one collective (default {GATHER_TOGETHER_BYTES}).")
    return value


def _mesh_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def check_parameters(module: nn.Module, ignored_params: set[nn.Parameter] | None) -> None:
    """torch's refusals of a parameter fully_shard would manage, by name: a scalar, a non-contiguous one; and
    flatshard's own: a tensor subclass other than DTensor (see below)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    ignored = set(ignored_params or ())
    for pname, p in module.named_parameters():
        if p in ignored or getattr(p, OWNER_ATTR, None) is not None:  # (an inner unit's)
            continue
        inner = p._local_tensor if _is_dtensor(p) else p.data
        if is_traceable_wrapper_subclass(inner):  # (its values would be flattened into a plain shard: lost silently)
            extensions = (" with FSDP2's all-gather extensions (fsdp_pre_all_gather / fsdp_post_all_gather)"
                          if hasattr(inner, "fsdp_pre_all_gather") else "")
            raise NotImplementedError(
                f"fully_shard: parameter '{pname}' of {type(module).__name__} is a {type(inner).__name__}, a tensor "
                f"subclass{extensions}; flatshard's fully_shard shards plain tensors and DTensors only, and would lose "
                f"what the subclass does (torchao's float8 and NF4 weights are such subclasses): use torch's "
                f"fully_shard for this model, or plain weights.")
        if p.ndim == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {pname} to a 1D tensor with numel "
                             f"equal to 1.")
        if not p.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: param.shape={p.shape} "
                f"param.stride()={p.stride()} ('{pname}' of {type(module).__name__}, e.g. a channels_last weight: "
                f"make it contiguous before fully_shard).")


def _check_supported(module: nn.Module, mesh: Any, reshard_after_forward: Any, shard_placement_fn: Callable | None,
                     mp_policy: Any, offload_policy: Any) -> None:
    from torch.distributed.fsdp import OffloadPolicy

    name = type(module).__name__
    if mesh.ndim not in (1, 2):  # (torch's ValueError; an SPMD mesh needs dp_mesh_dims, which flatshard refuses)
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: fully_shard({name}) was given a "
                         f"{mesh.ndim}-D mesh {tuple(mesh.shape)}; pass a 1-D mesh (FSDP) or a 2-D one (HSDP: "
                         f"replicate, shard).")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # (torch's AssertionError)
        raise AssertionError(f"Please init the 2D mesh for HSDP with mesh_dim_names specified (fully_shard({name}): "
                             f"e.g. init_device_mesh(device, {tuple(mesh.shape)}, mesh_dim_names=(\"replicate\", "
                             f"\"shard\"))).")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard({name}): offload_policy must be an OffloadPolicy (OffloadPolicy() for none, "
                        f"CPUOffloadPolicy() to keep the shards on the host) but got {type(offload_policy).__name__}.")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: {name} (no hook of "
                         f"it would ever run); call fully_shard on each of its modules, or on the module that runs "
                         f"them.")


def shard_dims(fn: Callable, mesh: Any, params: list[nn.Parameter], names: list[str], world_size: int) -> list[int]:
    """Each parameter's shard dim from ``shard_placement_fn`` ``fn`` (torch's rules: None is Shard(0), a negative dim
    counts from the end; a dim the parameter lacks, a dim d > 0 that does not divide by the shard group's size and
    another mesh are refused with torch's error types)."""
    from torch.distributed.tensor import Shard

    dims = []
    for name, p in zip(names, params):
        placement = fn(p)
        if placement is not None and not isinstance(placement, Shard):
            if type(placement).__name__ == "ShardPlacementResult":
                mesh_info = getattr(placement, "mesh_info", None)
                if getattr(mesh_info, "mesh", mesh) is not mesh:
                    raise NotImplementedError(f"fully_shard: shard_placement_fn gives parameter '{name}' a mesh of its "
                                              f"own, which no unit of its own was made for (see [Note: Parameters on "
                                              f"a mesh of their own] in _param_meshes.py).")
                placement = placement.placement
            else:
                raise ValueError(f"Invalid shard_placement_fn result: {placement} (for parameter '{name}')")
        dim = 0 if placement is None else placement.dim
        dim = dim + p.ndim if dim < 0 else dim
        if dim >= p.ndim:  # (torch's AssertionError and phrase)
            raise AssertionError(f"Shard dim {dim} is invalid for {p.ndim}D tensor: {p.shape} (parameter '{name}')")
        if dim > 0 and p.shape[dim] % world_size != 0:  # (torch's NotImplementedError and phrase)
            raise NotImplementedError(f"FSDP does not support uneven sharding on dim {dim}: {p.shape} (world size: "
                                      f"{world_size}) (parameter '{name}')")
        dims.append(dim)
    return dims


def _reshard_to(module: nn.Module, reshard_after_forward: Any, shard_size: int) -> bool | int:
    """FSDP2's ``reshard_after_forward`` given explicitly, as True, False or a group size N with 1 < N < the shard
    group's size (torch's rules: N = 1 is False, with a warning; N = the shard group's size is True)."""
    name = type(module).__name__
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"fully_shard({name}): reshard_after_forward should be a bool or an int representing the "
                         f"group size to reshard to, not {reshard_after_forward!r}")
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    if reshard_after_forward < 1 or reshard_after_forward > shard_size or shard_size % reshard_after_forward != 0:
        raise ValueError(f"fully_shard({name}): If passing reshard_after_forward as an int, it should be a factor of "
                         f"{shard_size}, not {reshard_after_forward} (the shard group's size; pass True to reshard "
                         f"to it, or a divisor of it).")
    if reshard_after_forward == 1:
        warnings.warn(f"fully_shard({name}): reshard_after_forward=1 (int) means resharding parameters to world size "
                      f"1, instead of reshard_after_forward=True (bool): the parameters stay unsharded after forward.",
                      stacklevel=4)
        return False
    return True if reshard_after_forward == shard_size else reshard_after_forward


# The post-forward groups made so far, by the mesh's ranks and the group size (every fully_shard call of a model
# with the same int would otherwise make its own groups); the default group is kept with them, so that a group of
# an earlier process group's lifetime is never taken for one of this one's.
_POST_FORWARD_GROUPS: dict[tuple, tuple[Any, dist.ProcessGroup]] = {}


def post_forward_group(mesh: Any, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of ``mesh`` (torch's post-forward mesh: the mesh viewed as
    (-1, size), HSDP's replicate dim flattened into the first), made by every rank of the default group at once."""
    world = dist.distributed_c10d._get_default_group()
    key = (id(world), tuple(mesh.mesh.flatten().tolist()), size)
    if key not in _POST_FORWARD_GROUPS:
        rows = mesh.mesh.reshape(-1, size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(rows, backend=dist.get_backend(mesh.get_group(mesh.ndim - 1)))
        _POST_FORWARD_GROUPS[key] = (world, group)
    return _POST_FORWARD_GROUPS[key][1]


def _mixed_precision(mp_policy: Any) -> MixedPrecision | None:
    """FSDP2's MixedPrecisionPolicy as the runtime's MixedPrecision (torch FSDP1's dataclass): the all-gather and
    compute in ``param_dtype``; the reduction in ``reduce_dtype``, else in ``param_dtype`` (FSDP2's rule); each
    unit's forward inputs cast to ``param_dtype`` with ``cast_forward_inputs``. ``output_dtype`` is the
    front-end's (its forward hook casts the outputs)."""
    if mp_policy.param_dtype is None and mp_policy.reduce_dtype is None:
        return None
    return MixedPrecision(param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype or mp_policy.param_dtype,
                          cast_forward_inputs=mp_policy.cast_forward_inputs,
                          cast_root_forward_inputs=mp_policy.cast_forward_inputs)


def _own_dtype(module: nn.Module, ignored_params: set[nn.Parameter] | None) -> torch.dtype | None:
    """The dtype of the module's first parameter fully_shard manages (None: it has none)."""
    ignored = ignored_params or set()
    return next((p.dtype for p in module.parameters() if p not in ignored), None)


def resolve(module: nn.Module, mesh: Any, reshard_after_forward: bool | int | None,
            shard_placement_fn: Callable | None, mp_policy: Any, offload_policy: Any,
            ignored_params: set[nn.Parameter] | None, dp_mesh_dims: Any = None) -> UnitConfig:
    """The configuration of the unit ``fully_shard`` makes of ``module``."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    spmd = None
    if dp_mesh_dims is not None:  # (the data-parallel dims' submesh from here on)
        mesh, spmd = _spmd_submesh(module, mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):  # (torch's)
            raise NotImplementedError(f"reshard_after_forward as int is not yet supported with SPMD mesh "
                                      f"(dp_mesh_dims): fully_shard({type(module).__name__}, reshard_after_forward="
                                      f"{reshard_after_forward}); pass True or False")
    mesh = mesh if mesh is not None else default_mesh()
    _check_supported(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy)
    if (isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory and
            _own_dtype(module, ignored_params) is not None and not torch.accelerator.is_available()):
        # (torch's RuntimeError, from pinning the first shard: pinned memory is for copies to an accelerator)
        raise RuntimeError(f"Cannot access accelerator device when none is available: fully_shard("
                           f"{type(module).__name__}) with CPUOffloadPolicy(pin_memory=True) pins the host shards, "
                           f"which needs an accelerator; without one pass CPUOffloadPolicy(pin_memory=False).")
    # 1-D: shard over the mesh. 2-D (HSDP): shard over its second dim, replicate over its first.
    group = mesh.get_group(mesh.ndim - 1)
    replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
    world_size = dist.get_world_size(group)
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    # None: True, and the root keeps its parameters after forward (its backward starts right away).
    given = reshard_after_forward is not None
    reshard_to = _reshard_to(module, reshard_after_forward, world_size) if given else True
    reshard = reshard_to is not False
    mp = _mixed_precision(mp_policy)
    # Without a reduce dtype the gradients are reduced in the parameters' own (an fp16 model's: FSDP2's overflow-safe
    # divisions, before and after the SUM)
    reduce_dtype = mp.reduce_dtype if mp is not None else _own_dtype(module, ignored_params)
    predivide, postdivide = divide_factors(reduce_dtype, world_size, replicas)
    return UnitConfig(
        process_group=group,
        replicate_group=replicate_group,
        rank=dist.get_rank(group),
        world_size=world_size,
        sharding_strategy=_strategy(reshard, replicate_group is not None),
        shard_factor=world_size,
        reshard_after_forward=reshard,
        predivide=predivide,
        postdivide=postdivide,
        divides_in_collectives=_divides_in_collectives(reduce_dtype, False),
        # FSDP2's implicit prefetch: in backward, the next unit's all-gather before this one's reduce-scatter; in
        # forward, see [Note: Forward prefetch where the host is the device].
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=mesh.device_type == "cpu",
        limit_all_gathers=True,
        gather_together_bytes=gather_together_bytes(mesh.device_type),
        mixed_precision=mp,
        # CPUOffloadPolicy: the shards, their gradients and the optimizer's step on the host; each all-gather
        # copies the shard to the device first (see [Note: Mixed precision and offload] in flat_param.h).
        offload_params=isinstance(offload_policy, CPUOffloadPolicy),
        pin_host_memory=getattr(offload_policy, "pin_memory", True),
        post_forward_group=(post_forward_group(mesh, reshard_to)
                            if not isinstance(reshard_to, bool) else None),
        use_orig_params=True,
        device_id=_mesh_device(mesh),
        param_init_fn=None,
        sync_module_states=False,
        device_mesh_given=True,
        ignored_modules=frozenset(),
        ignored_params=frozenset(ignored_params or ()),
        dim0_layout=True,
        mesh=mesh,
        shard_dims_of=(None if shard_placement_fn is None
                       else functools.partial(shard_dims, shard_placement_fn, mesh)),
        # A meta-device module's tensors: uninitialized on the device, as to_empty makes them (FSDP2's users
        # initialize after sharding: to_empty, then their own in-place init), not reset_parameters().
        meta_to_empty=True,
        output_dtype=mp_policy.output_dtype,
        # Given explicitly (not None), True holds for the root as well, as torch's: freed after its forward.
        root_reshards_after_forward=given and reshard,
        # Without grad as with it (torch FSDP2's): the root keeps its parameters unless told to free them.
        reshard_after_no_grad_forward=False,
        registers_unsharded=True,
        spmd=spmd,
    )


# [Note: torch's SPMD path]
# With ``dp_mesh_dims``, torch's FSDP2 takes a mesh on which every parameter is already a DTensor (torchtitan's
# "full_dtensor" backend: ``distribute_module``, or its TP plan on the full mesh, then ``fully_shard``; its inputs are
# DTensors too) and shards over the dims ``dp_mesh_dims`` names: one shard dim and at most one replicate dim here (torch
# also flattens several into one: refused by name), the others (TP's, CP's) left as they are. Each parameter goes the
# way of a tensor-parallel one (see [Note: Tensor-parallel parameters] in _tensor_parallel.py), with the full mesh as
# its "TP mesh": its local tensor is sharded over the shard dim's group (the groups come from the data-parallel dims'
# submesh, ``config.mesh``); the sharded parameter is a DTensor on the full mesh whose shard dim's placement becomes
# ``Shard(d)`` (``_StridedShard`` where a later mesh dim shards d too), the others kept, as torch's; in forward and
# backward the module holds the unsharded value as the DTensor it was. Its gradient keeps its placements on the
# data-parallel dims (Partial or Replicate: its local tensor is what the reduce-scatter sums) and is redistributed to
# the parameter's placements on the others (a Partial over TP all-reduced there), as torch's ``_get_grad_inner_tensor``
# does (``_TPView.backward``). Refused: a data-parallel dim that is not Replicate (torch's ValueError), a parameter on
# another mesh or Partial on it, several dims flattened into one, replication alone (DDP), reshard_after_forward as an
# int; a plain tensor parameter gets torch's ValueError.
def _spmd_submesh(module: nn.Module, mesh: Any, dp_mesh_dims: Any) -> tuple[Any, tuple[Any, frozenset[int]]]:
    """(the data-parallel dims' submesh, (the full mesh, their indices in it)) for ``dp_mesh_dims``."""
    name = type(module).__name__
    if mesh is None:
        raise ValueError(f"fully_shard({name}): dp_mesh_dims names dims of the mesh given as mesh=, and none was given")
    shard, replicate = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    dims = tuple(mesh.mesh_dim_names or ())
    wanted = (*replicate, *shard)
    # (torch's ValueErrors and phrases, in its order)
    if dp_mesh_dims.shard is None and dp_mesh_dims.replicate is None:
        raise ValueError(f"At least one of shard or replicate must be set in dp_mesh_dims (fully_shard({name}))")
    if mesh.mesh_dim_names is None:
        raise ValueError(f"mesh must have mesh_dim_names when dp_mesh_dims is provided (fully_shard({name}) was given "
                         f"{mesh}); name its dims in init_device_mesh(..., mesh_dim_names=...)")
    for dim in (*shard, *replicate):  # (torch's order)
        if dim not in dims:
            raise ValueError(f"Mesh dim name '{dim}' not found in mesh.mesh_dim_names {dims} (fully_shard({name}), "
                             f"dp_mesh_dims={dp_mesh_dims})")
    if len(shard) != 1 or len(replicate) > 1 or [d for d in dims if d in wanted] != list(wanted):
        raise NotImplementedError(
            f"fully_shard({name}): dp_mesh_dims (shard={dp_mesh_dims.shard!r}, replicate={dp_mesh_dims.replicate!r}) "
            f"over a mesh of dims {dims}: flatshard supports torch's SPMD path with one shard dim, after at most one "
            f"replicate dim, of the mesh (not several flattened into one, nor replication alone; see [Note: torch's "
            f"SPMD path]).")
    indices = frozenset(dims.index(d) for d in wanted)
    return (mesh if len(wanted) == mesh.ndim else mesh[wanted]), (mesh, indices)


def _divides_in_collectives(reduce_dtype: torch.dtype | None, force_sum: bool) -> bool:
    """Whether torch's FSDP2 divides inside its collectives (ReduceOp.AVG or PREMUL_SUM): in fp32 and bf16 unless
    summing is forced; else it sums and divides apart (see ``divide_factors``)."""
    return reduce_dtype in (None, torch.float32, torch.bfloat16) and not force_sum


def divide_factors(reduce_dtype: torch.dtype | None, world_size: int, replicas: int, factor: float | None = None,
                   force_sum: bool = False) -> tuple[float, float]:
    """How FSDP2 divides a gradient, as the runtime's (before, after) the SUM. By default it averages over every
    data-parallel rank: in fp32 and bf16 one division after the SUMs (ReduceOp.AVG), in other dtypes (fp16) a
    division before and one after, so that the SUM neither overflows nor underflows. ``factor``
    (``set_gradient_divide_factor``) divides by that instead: in fp32 and bf16 before the SUM, as NCCL's
    PREMUL_SUM multiplies (flatshard divides where NCCL multiplies by 1/factor: the same but for the last bit),
    or after it when it is the shard group's size (AVG); ``force_sum`` (``set_force_sum_reduction_for_comms``):
    the SUM, then the division."""
    data_parallel = float(world_size * replicas)
    overflow_risk = reduce_dtype not in (None, torch.float32, torch.bfloat16)
    if _divides_in_collectives(reduce_dtype, force_sum):
        if factor is None:
            return 1.0, data_parallel
        return (1.0, float(factor)) if factor == world_size else (float(factor), 1.0)
    factor = data_parallel if factor is None else float(factor)
    return gradient_divide_factors(factor) if overflow_risk else (1.0, factor)


def _strategy(reshard_after_forward: bool, hybrid: bool) -> ShardingStrategy:
    """The runtime's strategy for FSDP2's resharding choice (FSDP1's names for the same two schedules)."""
    if hybrid:
        return ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def with_reshard_after_forward(config: UnitConfig, reshard_after_forward: bool) -> UnitConfig:
    """``config`` after ``FSDPModule.set_reshard_after_forward``: the unit, root included, frees its parameters
    after forward or keeps them (a bool, as torch's: a post-forward group is dropped)."""
    return dataclasses.replace(config, reshard_after_forward=reshard_after_forward,
                               root_reshards_after_forward=reshard_after_forward, post_forward_group=None,
                               sharding_strategy=_strategy(reshard_after_forward, config.replicate_group is not None))


def with_divide_factors(config: UnitConfig, factor: float | None, force_sum: bool,
                        own_dtype: torch.dtype | None = None) -> UnitConfig:
    """``config`` after ``FSDPModule.set_gradient_divide_factor`` / ``set_force_sum_reduction_for_comms``
    (``own_dtype``: the parameters', the reduction's without a reduce dtype)."""
    replicas = dist.get_world_size(config.replicate_group) if config.replicate_group is not None else 1
    reduce_dtype = config.mixed_precision.reduce_dtype if config.mixed_precision is not None else own_dtype
    predivide, postdivide = divide_factors(reduce_dtype, config.world_size, replicas, factor, force_sum)
    return dataclasses.replace(config, gradient_divide_factor=factor, force_sum_reduction=force_sum,
                               predivide=predivide, postdivide=postdivide,
                               divides_in_collectives=_divides_in_collectives(reduce_dtype, force_sum))


def _is_dtensor(p: Any) -> bool:
    return hasattr(p, "_spec") and hasattr(p, "_local_tensor")


def take_tp_locals(modules: list[nn.Module], config: UnitConfig, reshard_after_forward: Any,
                   shard_placement_fn: Callable | None) -> dict[int, _tensor_parallel.TPParam]:
    """See [Note: Tensor-parallel parameters] in _tensor_parallel.py: the DTensor parameters the unit of ``modules``
    (configured as ``config``) will manage are replaced on every module registering them by an ``nn.Parameter`` of
    their local tensor (a tied one by one parameter); returns {id of that parameter: what it was}. Every refusal is
    made before anything is replaced."""
    ignored = config.ignored_params
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for unit_module in modules:
        for name, p in unit_module.named_parameters(remove_duplicate=True):
            if p in ignored or getattr(p, OWNER_ATTR, None) is not None:
                continue
            if not _is_dtensor(p):
                if config.spmd is not None:  # (torch's ValueError and phrase: see [Note: torch's SPMD path])
                    raise ValueError(f"When dp_mesh_dims is provided, all parameters must be DTensors on the full "
                                     f"SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
                                     f"'{name}'.")
                continue
            found.setdefault(id(p), (name, p))
    if not found:
        return {}
    taken: dict[int, _tensor_parallel.TPParam] = {}
    replacement: dict[int, nn.Parameter] = {}
    for name, p in found.values():
        describe = _describe if config.spmd is None else _describe_on_spmd_mesh  # (see [Note: torch's SPMD path])
        info = describe(name, p, config, reshard_after_forward if config.post_forward_group is not None else None,
                        shard_placement_fn)
        local = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
        replacement[id(p)] = local
        taken[id(local)] = info
    for unit_module in modules:
        for m in unit_module.modules():
            for attr, p in list(m._parameters.items()):
                if p is not None and id(p) in replacement:
                    m._parameters[attr] = replacement[id(p)]
    return taken


def _describe(name: str, p: Any, config: UnitConfig, reshard_after_forward: Any,
              shard_placement_fn: Callable | None) -> _tensor_parallel.TPParam:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dp_mesh = config.mesh
    spec = p._spec
    tp_mesh, tp_placements = spec.mesh, tuple(spec.placements)
    where = f"fully_shard: parameter '{name}' is a DTensor over {tp_mesh}"
    dp_names = set(dp_mesh.mesh_dim_names or ())
    if tp_mesh is dp_mesh or (tp_mesh.mesh_dim_names and dp_names & set(tp_mesh.mesh_dim_names)):
        raise NotImplementedError(f"{where}, which shares a dim with fully_shard's mesh {dp_mesh}: that is torch's "
                                  f"SPMD path, which takes dp_mesh_dims; otherwise flatshard supports a parameter "
                                  f"over a TP mesh separate from the DP mesh, as parallelize_module(block, "
                                  f"world_mesh['tp'], plan) then fully_shard(block, mesh=world_mesh['dp']) make.")
    if tp_mesh.ndim != 1:
        raise NotImplementedError(f"{where} of {tp_mesh.ndim} dims: flatshard's fully_shard supports tensor "
                                  f"parallelism over a 1-D mesh beneath it (no EP+TP yet).")
    if not all(isinstance(pl, (Shard, Replicate)) for pl in tp_placements):
        raise NotImplementedError(f"{where} with placements {tp_placements}: fully_shard takes parameters sharded "
                                  f"(Shard) or replicated (Replicate) over their TP mesh, not partial ones.")
    if reshard_after_forward is not None:  # (an int N below the shard group's size)
        raise NotImplementedError(f"{where}: resharding to a smaller mesh after forward (reshard_after_forward="
                                  f"{reshard_after_forward}) is not supported for DTensor parameters, by torch's "
                                  f"FSDP2 either; pass True or False.")
    if tp_mesh.device_type != dp_mesh.device_type:
        raise ValueError(f"{where} on {tp_mesh.device_type}, fully_shard's mesh is on {dp_mesh.device_type}")
    # As torch's: shard_placement_fn sees the DTensor; the dim is of its local tensor, which must divide by the
    # shard group's size where it is not 0.
    dim = 0 if shard_placement_fn is None else shard_dims(lambda _local: shard_placement_fn(p), dp_mesh,
                                                          [p._local_tensor], [name], config.world_size)[0]
    split = 1  # (how many TP shards this dim is cut into: FSDP's chunks of a local tensor are strided globally)
    for pl, size in zip(tp_placements, tp_mesh.shape):
        if isinstance(pl, Shard) and pl.dim == dim:
            split *= size
    fsdp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    dp_placements = (fsdp,) if dp_mesh.ndim == 1 else (Replicate(), fsdp)
    mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    return _tensor_parallel.TPParam(tp_mesh, tp_placements, spec.shape, tuple(spec.stride), mesh,
                                    dp_placements + tp_placements, dim)


def _describe_on_spmd_mesh(name: str, p: Any, config: UnitConfig, reshard_after_forward: Any,
                           shard_placement_fn: Callable | None) -> _tensor_parallel.TPParam:
    """``_describe`` for a parameter on the full mesh ``dp_mesh_dims`` came with (see [Note: torch's SPMD path])."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    full, dp_indices = config.spmd
    spec = p._spec
    given = tuple(spec.placements)
    if spec.mesh is not full:  # (torch's ValueError and phrase: the same object, not an equal one)
        raise ValueError(f"Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
                         f"different mesh objects (parameter '{name}' is a DTensor over {spec.mesh}; fully_shard was "
                         f"given {full} with dp_mesh_dims)")
    for i in sorted(dp_indices):  # (torch's ValueError and phrase)
        if not given[i].is_replicate():
            raise ValueError(f"Expected Replicate() on DP dim '{full.mesh_dim_names[i]}' (index {i}) but got "
                             f"{given[i]} (parameter '{name}')")
    if not all(isinstance(pl, (Shard, Replicate)) and type(pl) is not _StridedShard for pl in given):
        raise NotImplementedError(f"fully_shard: parameter '{name}' has placements {given} on {full}: fully_shard "
                                  f"takes parameters sharded (Shard) or replicated (Replicate) on the mesh's other "
                                  f"dims, not partial ones.")
    if reshard_after_forward is not None:
        raise NotImplementedError(f"fully_shard: parameter '{name}': resharding to a smaller mesh after forward "
                                  f"(reshard_after_forward={reshard_after_forward}) with dp_mesh_dims; pass True or "
                                  f"False.")
    dim = 0 if shard_placement_fn is None else shard_dims(lambda _local: shard_placement_fn(p), config.mesh,
                                                          [p._local_tensor], [name], config.world_size)[0]
    shard_index = max(dp_indices)  # (the shard dim comes after the replicate dim)
    split = 1  # (the later dims that shard `dim` too: this dim's FSDP chunks are strided)
    for j in range(shard_index + 1, full.ndim):
        if isinstance(given[j], Shard) and given[j].dim == dim:
            split *= full.size(j)
    sharded = list(given)
    sharded[shard_index] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    return _tensor_parallel.TPParam(full, given, spec.shape, tuple(spec.stride), full, tuple(sharded), dim)
