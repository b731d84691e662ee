"""``fully_shard``: torch FSDP2's API over the flatshard runtime.

[Note: fully_shard]
``fully_shard(module)`` makes ``module`` a unit (one per call, applied bottom-up as FSDP2 users do: the blocks
first, then the root), as the class makes its wrapper one; the unit is the module itself. What differs from
the class is only what the front-end resolves and how it presents the parameters:
- ``_fsdp2_config.resolve`` turns the arguments into the frozen ``UnitConfig`` (see [Note: Unit
  configuration]), with FSDP2's layout (``dim0_layout``: see [Note: Dim-0 layout] in
  csrc/flatshard/layout.h) and its mesh;
- the construction (``_construction.build_flat_param``) is the class's, the unit's parameters becoming
  DTensors over its shard (see [Note: DTensor parameters] in _dtensor_params.py);
- the lifecycle is the runtime's (``_runtime.begin_forward`` / ``end_forward``), called from a forward pre-hook
  and a forward hook on the module, as FSDP2 does, so that a forward replaced on the instance (frameworks
  patch ``model.forward``) still runs inside them;
- the module's class becomes a dynamic subclass ``FSDP<Class>`` of ``FSDPModule``, which is an instance of
  torch's ``FSDPModule``, with FSDP2's methods.

[Note: fully_shard's coverage]
This first version trains on a 1-D mesh or HSDP's 2-D one, ``reshard_after_forward`` True, False or an int (None:
True, and the root keeps its parameters after forward; an int N: see [Note: Reshard to a smaller group] in
csrc/flatshard/flat_param.h), ``mp_policy`` (every field), ``CPUOffloadPolicy`` (the runtime's offload),
``ignored_params``, ``shard_placement_fn`` giving ``Shard(i)`` (see [Note: Sharding on another dim] in
csrc/flatshard/layout.h), and parameters that are DTensors over a TP mesh (see [Note: Tensor-parallel parameters] in
_tensor_parallel.py). What it does not support yet raises NotImplementedError naming the argument or method:
meshes of 3 or more dims (but see ``dp_mesh_dims``: [Note: torch's SPMD path] in _fsdp2_config.py), a parameter
given a mesh of its own that no submodule holds alone (see [Note: Parameters on a mesh of their own] in
_param_meshes.py), and the FSDPModule methods listed in ``_NOT_YET`` (_fsdp_module.py). A list of modules is one unit
(see [Note: A list of modules]). The module's forward hooks and FSDPModule's methods are in _fsdp_module.py.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from flatshard import _construction, _dtensor_params, _fsdp2_config, _param_meshes, _runtime
from flatshard._common import is_unit
from flatshard._fsdp_module import _UNITS, FSDPModule, _post_forward_hook, _pre_forward_hook
from flatshard._state import UnitState
from flatshard._torch_facade import composable_registry, fsdp2_state

__all__ = ["FSDPModule", "fully_shard"]


def fully_shard(module: nn.Module, *, mesh: Any = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims: Any = None) -> nn.Module:
    """torch's ``torch.distributed.fsdp.fully_shard`` on flatshard's runtime (see [Note: fully_shard] and
    [Note: fully_shard's coverage]). Returns ``module``, now an ``FSDPModule``."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard: expected an nn.Module or a non-empty list of them but got an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard: expected an nn.Module but got {type(m).__name__}")
    ignored_params = composable_registry.with_replicated_params(modules, ignored_params)
    for m in modules:
        if is_unit(m):  # (torch's AssertionError and phrase)
            raise AssertionError(f"Each distinct composable distributed API can only be applied to a module once. "
                                 f"fully_shard has already been applied to {type(m).__name__} (or it is a "
                                 f"FullyShardedDataParallel); call fully_shard once per module.")
        _fsdp2_config.check_parameters(m, ignored_params)
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: the list of modules names one module twice")
    # (parameters shard_placement_fn puts on another mesh: units of their own first, see [Note: Parameters on a mesh of
    # their own] in _param_meshes.py)
    if mesh is None and shard_placement_fn is not None and dp_mesh_dims is None:  # (the mesh the others differ from)
        mesh = _fsdp2_config.default_mesh()
    apart = _param_meshes.shard_apart(modules, mesh, shard_placement_fn, ignored_params, fully_shard,
                                      reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                                      offload_policy=offload_policy)
    config = _fsdp2_config.resolve(modules[0], mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                                   offload_policy, ignored_params, dp_mesh_dims)
    # One unit for all of them (see [Note: A list of modules]): the first is the unit's module.
    # DTensor parameters over a TP mesh: their local tensors are what this unit shards (see [Note: Tensor-parallel
    # parameters] in _tensor_parallel.py)
    taken = _fsdp2_config.take_tp_locals(modules, config, reshard_after_forward, shard_placement_fn)
    state = UnitState("", modules[0], config, config.device_id)
    state.tp_params = taken
    state.apart_units = tuple(m._unit_state for m in apart)
    if len(modules) > 1:
        state.members = tuple(modules)
    for m in modules:
        m.__dict__["_unit_state"] = state
    _construction.build_flat_param(modules[0], modules[0], more_modules=modules[1:])
    if state.handle is not None:
        _runtime.set_views(state, state.placeholders, placeholders=True)
    # The state dict's values saved and copied as torch's (see [Note: A state dict's tensors have storages of their
    # own] in _dtensor_params.py): on each module that registers the unit's parameters.
    for m in {id(m): m for m, _, _ in state.param_slots}.values():
        m.register_state_dict_post_hook(_own_storages)
    for m in modules:
        m.register_forward_pre_hook(_pre_forward_hook, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward_hook, with_kwargs=True, always_call=True)
        # load_state_dict(assign=True) replaces the parameters: their values go into the shard (see rebind).
        m.register_load_state_dict_post_hook(_after_load)
        # A state dict (saved or loaded) is of the registered DTensors: a unit holding its parameters unsharded (a
        # root after its forward) reshards first, as torch's.
        m.register_state_dict_pre_hook(_reshard_for_state_dict)
        m.register_load_state_dict_pre_hook(_reshard_for_state_dict)
        m.__class__ = _fsdp_class(type(m))
        fsdp2_state.register(m)  # (what torch's pipelining reads: see [Note: Pipelining reduces the gradients itself])
        composable_registry.mark(m)  # (what torch's replicate reads: see [Note: Composing with torch's replicate])
        _UNITS.add(m)
    return module


# torch's ``fully_shard.state(module)`` on flatshard's function too (a script that changed its import): the state
# torch's contract filed on the module, a flatshard module's PipelinedState (see [Note: Pipelining reduces the
# gradients itself] in _torch_facade/fsdp2_state.py), else None.
fully_shard.state = fsdp2_state.state_of


# [Note: A list of modules]
# ``fully_shard([norm, lm_head])`` (accelerate's FSDP2 path shards a model's tail so) makes one unit of several
# modules: one set of parameters gathered and reduced together, the modules sharing one UnitState (the first is
# its module). Each member's forward is one use of the unit, as a module called
# twice is (see [Note: Unit lifecycle] in _runtime.py): the first gathers the parameters, and a member that runs
# after another reshard it gathers them again; torch's FSDP2 instead holds them from the first member's forward
# to the last one's, which saves that all-gather (the same values either way). The runtime walks each unit once
# (``_runtime._units_under`` by state); the parameters' local names are the members' own, prefixed by their
# index in the list after the first (``1.weight``).


def _reshard_for_state_dict(module: nn.Module, *_args: Any) -> None:
    module.reshard()


def _own_storages(module: nn.Module, state_dict: dict, prefix: str, _local_metadata: Any) -> None:
    _dtensor_params.own_storages(module, state_dict, prefix)


def _after_load(module: nn.Module, _incompatible_keys: Any) -> None:
    if module._unit_state.handle is not None:
        _dtensor_params.rebind(module._unit_state)


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``FSDPModule`` first in the method resolution order, as torch's (made once per class)."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]
