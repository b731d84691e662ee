"""torch's ``torch.distributed.checkpoint.state_dict`` functions, for flatshard models.

[Note: torch's state-dict helpers]
torch's ``get_state_dict`` / ``set_state_dict`` (and the model / optimizer halves)
recognise FSDP by torch's own classes (``FSDP.fsdp_modules``, ``isinstance(m, FSDP)``);
there is no hook for another implementation. On a flatshard model they would see
plain modules: the model's state dict would be whatever type is set, and the
optimizer's would hold each rank's flat shard under the same name and shape, which
``torch.distributed.checkpoint`` takes for replicas and keeps one of — a checkpoint
that silently loses the other ranks' optimizer state. So flatshard units answer
torch's ``_fqn_modifiers`` probe (the one hook those helpers call on every module,
and only they) with an error naming the fix, and these functions take their place,
with the same signatures and ``StateDictOptions``: SHARDED state dicts (DTensors; see ``_state_dict_type``)
by default, FULL ones with ``full_state_dict=True``. A model without flatshard units
is passed to torch's own functions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions

from flatshard._broadcast import broadcast_from_rank0
from flatshard._common import clean_name, fsdp_modules, is_unit, join
from flatshard._optim_state_dict import optim_state_dict, optim_state_dict_to_load
from flatshard._state_dict import state_dict_type
from flatshard.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

# torch's own functions, as they were when flatshard was imported: the fallbacks for models without flatshard
# units call these, not the module's attributes (which the opt-in makes these functions themselves).
TORCH_FUNCTIONS = {name: getattr(torch_dsd, name) for name in __all__ if name != "StateDictOptions"}

TORCH_HELPERS_ERROR = (
    "torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict (and get/set_model_"
    "state_dict, get/set_optimizer_state_dict) recognise only torch's own FSDP classes: on a flatshard "
    "model they would save each rank's optimizer shard under one name, and torch.distributed.checkpoint "
    "would keep only one rank's copy. Import the same functions from flatshard instead: "
    "`from flatshard.checkpoint import get_state_dict, set_state_dict` (same signatures and "
    "StateDictOptions), or leave the script as it is and set FLATSHARD_AS_TORCH_FSDP=1 in its "
    "environment (or call flatshard.install_as_torch_fsdp() first), which makes torch's functions "
    "flatshard's."
)


def get_model_state_dict(
    model: nn.Module, *, submodules: set[nn.Module] | None = None, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """As torch's: the model's state dict, SHARDED (DTensors) or with ``full_state_dict`` FULL. Collective."""
    if not fsdp_modules(model):
        return TORCH_FUNCTIONS["get_model_state_dict"](model, submodules=submodules, options=options)
    options = _checked(options, submodules, "get_model_state_dict")
    with _state_dict_type(model, options):
        state = model.state_dict()
    if options.ignore_frozen_params:
        frozen = _frozen_names(model)
        state = type(state)((k, v) for k, v in state.items() if k not in frozen)
    return state


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """As torch's: the optimizers' state under the original parameter names, merged. Collective.

    An optimizer that has not stepped yet gets its state first (a step with zero gradients
    and a zero learning rate, as torch does), so that the result can be a target for
    ``torch.distributed.checkpoint.load``.
    """
    optimizers = _as_tuple(optimizers)
    if not fsdp_modules(model):
        return TORCH_FUNCTIONS["get_optimizer_state_dict"](model, optimizers, submodules=submodules, options=options)
    options = _checked(options, submodules, "get_optimizer_state_dict")
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    with _state_dict_type(model, options):
        for optim in optimizers:
            _init_optim_state(optim)
            osd = optim_state_dict(model, optim)
            if osd:  # {} on ranks other than 0 with full_state_dict and cpu_offload
                merged["state"].update(osd["state"])
                merged["param_groups"].extend(osd["param_groups"])
    if not merged["param_groups"]:
        return {}
    if options.ignore_frozen_params:
        frozen = _frozen_names(model)
        merged["state"] = {k: v for k, v in merged["state"].items() if k not in frozen}
    return merged


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """As torch's: ``(get_model_state_dict(...), get_optimizer_state_dict(...))``. Collective."""
    if not fsdp_modules(model):
        return TORCH_FUNCTIONS["get_state_dict"](model, optimizers, submodules=submodules, options=options)
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, Any], *, options: StateDictOptions | None = None
) -> Any:
    """As torch's: loads a SHARDED or FULL model state dict; returns the missing and unexpected keys.

    With ``broadcast_from_rank0`` only rank 0 needs to pass the (full) state dict.
    """
    if not fsdp_modules(model):
        return TORCH_FUNCTIONS["set_model_state_dict"](model, model_state_dict, options=options)
    options = _checked(options, None, "set_model_state_dict")
    if options.broadcast_from_rank0:
        model_state_dict = broadcast_from_rank0(model_state_dict, 'set_state_dict')
    with _state_dict_type(model, options):
        return model.load_state_dict(model_state_dict, strict=options.strict)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """As torch's: loads what ``get_optimizer_state_dict`` returned into each optimizer (each takes
    its own param groups, in order, and the state of their parameters)."""
    optimizers = _as_tuple(optimizers)
    if not fsdp_modules(model):
        return TORCH_FUNCTIONS["set_optimizer_state_dict"](model, optimizers, optim_state_dict, options=options)
    options = _checked(options, None, "set_optimizer_state_dict")
    if options.full_state_dict and (options.broadcast_from_rank0 or options.cpu_offload):
        optim_state_dict = broadcast_from_rank0(optim_state_dict, 'set_state_dict')  # as torch's rank0_only optimizer config: rank 0's
    groups = list(optim_state_dict.get("param_groups", []))
    wanted = sum(len(o.param_groups) for o in optimizers)
    if len(groups) != wanted:
        raise ValueError(
            f"flatshard.checkpoint.set_optimizer_state_dict: the state dict has {len(groups)} param groups but "
            f"the optimizers have {wanted}; pass what get_optimizer_state_dict returned for these optimizers."
        )
    with _state_dict_type(model, options):
        for optim in optimizers:
            mine, groups = groups[: len(optim.param_groups)], groups[len(optim.param_groups):]
            names = {n for g in mine for n in g["params"]}
            osd = {"state": {k: v for k, v in optim_state_dict["state"].items() if k in names}, "param_groups": mine}
            optim.load_state_dict(optim_state_dict_to_load(model, optim, osd, from_rank0=False))


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> Any:
    """As torch's: ``set_optimizer_state_dict`` then ``set_model_state_dict``; returns the model's
    missing and unexpected keys."""
    if not fsdp_modules(model):
        return TORCH_FUNCTIONS["set_state_dict"](model, optimizers, model_state_dict=model_state_dict,
                                        optim_state_dict=optim_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return set_model_state_dict(model, model_state_dict, options=options)


def _checked(options: StateDictOptions | None, submodules: Any, what: str) -> StateDictOptions:
    options = options or StateDictOptions()
    unsupported = [name for name, bad in (
        ("submodules", bool(submodules)),
        ("flatten_optimizer_state_dict=True", options.flatten_optimizer_state_dict),
    ) if bad]
    if unsupported:
        raise NotImplementedError(
            f"flatshard.checkpoint.{what}: {' and '.join(unsupported)} is not implemented in flatshard; "
            f"save the whole model with the nested optimizer state dict (the default)."
        )
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(f"flatshard.checkpoint.{what}: broadcast_from_rank0=True needs full_state_dict=True "
                         f"(as in torch).")
    return options


@contextlib.contextmanager
def _state_dict_type(model: nn.Module, options: StateDictOptions) -> Iterator[None]:
    if options.full_state_dict:  # as torch: cpu_offload puts the full dicts on rank 0 only
        settings = (StateDictType.FULL_STATE_DICT,
                    FullStateDictConfig(offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload),
                    FullOptimStateDictConfig(offload_to_cpu=options.cpu_offload,
                                             rank0_only=options.cpu_offload or options.broadcast_from_rank0))
    else:
        # DTensors (torch's helpers give its FSDP1's ShardedTensors without a device_mesh): a ShardedTensor
        # holds no shard on the ranks past a small parameter's last chunk, and torch.distributed.checkpoint
        # then cannot rebuild the optimizer state dict it loads into (torch's helpers fail there too).
        settings = (StateDictType.SHARDED_STATE_DICT,
                    ShardedStateDictConfig(offload_to_cpu=options.cpu_offload, _use_dtensor=True),
                    ShardedOptimStateDictConfig(offload_to_cpu=options.cpu_offload, _use_dtensor=True))
    with state_dict_type(model, *settings):
        yield


def _frozen_names(model: nn.Module) -> set[str]:
    """Original names of the parameters that do not require a gradient."""
    frozen: set[str] = set()
    path_of = {id(m): clean_name(n) for n, m in model.named_modules() if is_unit(m)}
    for unit in fsdp_modules(model):
        if unit._unit_state.handle is None:
            continue
        state = unit._unit_state
        indices = range(len(state.param_local_names)) if not state.flat_param.requires_grad else state.frozen_indices
        frozen.update(join(path_of[id(unit)], state.param_local_names[i]) for i in indices)
    frozen.update(clean_name(n) for n, p in model.named_parameters() if not p.requires_grad)
    return frozen


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state, if it has none, by a step that changes nothing."""
    if optim.state or any(p.grad is not None for g in optim.param_groups for p in g["params"]):
        return
    for group in optim.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
    optim.zero_grad(set_to_none=True)


def _as_tuple(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
