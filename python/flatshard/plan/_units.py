"""Which units a wrap makes, what each holds and how it is laid out, without wrapping anything.

The same decisions the constructor makes (see ``FullyShardedDataParallel.__init__`` and
``_construction.build_flat_param``), read off a module on the meta device: the auto-wrap
plan (``wrap._plan_wraps``, per-unit overrides included), each unit's parameters (its
subtree minus inner units and ignored modules, shared parameters once), the layout of its
flat parameter from the runtime's own ``FlatParamLayout`` (padding included), and the
dtypes it gathers and reduces in (``_mixed_precision.flat_param_dtypes``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from flatshard import _C, _mixed_precision
from flatshard._common import RESHARD_AFTER_FORWARD
from flatshard._construction import unit_modules
from flatshard.api import MixedPrecision, ShardingStrategy
from flatshard.wrap import _plan_wraps


@dataclasses.dataclass
class PlannedUnit:
    """One unit as the constructor would make it."""

    name: str  # its path under the root ("" for the root)
    numel: int  # its parameters' elements (shared ones once)
    trainable_numel: int  # of which require grad
    layout: Any  # _C.FlatParamLayout
    dtype: torch.dtype  # the parameters' (and the shard's) dtype
    param_dtype: torch.dtype  # what it gathers and computes in
    reduce_dtype: torch.dtype  # what its gradient is reduced in
    is_root: bool
    reshard_after_forward: bool
    reduces_prefix: bool  # use_orig_params with frozen and trainable parameters: an all-reduce of the prefix
    param_names: tuple[str, ...] = ()  # its parameters' names under the root (shared ones once)
    # fully_shard's (see [Note: A fully_shard plan] in plan/__init__.py): the root frees its parameters after
    # forward too (reshard_after_forward=True given), and the elements of each rank's shard its reduce-scatter
    # takes (frozen parameters: the trainable rows alone; else the whole shard)
    root_reshards_after_forward: bool = False
    reduce_shard_numel: int | None = None

    @property
    def replicated(self) -> bool:
        return self.layout.shard_factor == 1


def planned_units(
    model: nn.Module,
    shard_factor: int,
    strategy: ShardingStrategy,
    auto_wrap_policy: Any = None,
    mixed_precision: MixedPrecision | None = None,
    offload_params: bool = False,
    use_orig_params: bool = False,
    ignored_modules: Iterable[nn.Module] = (),
    fully_shard: bool = False,
    root_reshards_after_forward: bool = False,
) -> list[PlannedUnit]:
    """The units of ``FullyShardedDataParallel(model, ...)``, the root first, then in module order; with
    ``fully_shard``, those of ``fully_shard`` called on each module the policy picks, then on the root (FSDP2's
    dim-0 layout, its original parameters, its trainable rows reduce-scattered)."""
    ignored = {m for top in ignored_modules for m in top.modules()}
    ignored_params = {p for m in ignored for p in m.parameters(recurse=False)}
    overrides: dict[nn.Module, dict[str, Any]] = {model: {}}
    if auto_wrap_policy is not None:
        individually = _mixed_precision.individually_wrapped(mixed_precision)
        for target, extra in _plan_wraps(model, auto_wrap_policy, ignored, ignored_params, lambda m: False,
                                         individually):
            overrides[target] = extra
    names = {m: name for name, m in model.named_modules(remove_duplicate=False)}
    param_names = {id(p): name for name, p in model.named_parameters()}
    units = []
    for target in sorted(overrides, key=lambda m: list(names).index(m) if m in names else -1):
        params = _unit_params(target, set(overrides) - {target}, ignored, ignored_params)
        if not params:
            continue
        extra = overrides[target]
        unit_strategy = extra.get("sharding_strategy", strategy)
        factor = 1 if unit_strategy == ShardingStrategy.NO_SHARD else shard_factor
        unit_mp = extra.get("mixed_precision", mixed_precision)
        dtype = params[0].dtype
        dtypes = _mixed_precision.flat_param_dtypes(unit_mp, dtype, factor == 1, offload_params, names[target])
        trainable = sum(p.numel() for p in params if p.requires_grad)
        shapes = [list(p.shape) for p in params]
        layout = _C.FlatParamLayout.dim0(shapes, factor) if fully_shard else _C.FlatParamLayout(shapes, factor)
        reduce_shard_numel = None
        if fully_shard:  # (trainable parameters first: their rows are the shard's prefix, see [Note: Trainable prefix])
            reduce_shard_numel = sum(layout.rows_per_shard(i) * layout.row_numel(i)
                                     for i, p in enumerate(params) if p.requires_grad)
        units.append(PlannedUnit(
            name=names[target],
            numel=sum(p.numel() for p in params),
            trainable_numel=trainable,
            layout=layout,
            dtype=dtype,
            param_dtype=dtypes["param_dtype"] or dtype,
            reduce_dtype=dtypes["reduce_dtype"] or dtype,
            is_root=target is model,
            reshard_after_forward=unit_strategy in RESHARD_AFTER_FORWARD,
            reduces_prefix=(not fully_shard and use_orig_params and 0 < trainable < sum(p.numel() for p in params)
                            and factor > 1),
            param_names=tuple(param_names[id(p)] for p in params if id(p) in param_names),
            root_reshards_after_forward=fully_shard and target is model and root_reshards_after_forward,
            reduce_shard_numel=reduce_shard_numel,
        ))
    return units


def _unit_params(target: nn.Module, other_units: set[nn.Module], ignored: set[nn.Module],
                 ignored_params: set[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters ``target``'s unit owns (shared ones once), trainable ones first (as build_flat_param orders
    them with use_orig_params)."""
    params: dict[int, nn.Parameter] = {}
    for _, module in unit_modules(target, ignored, lambda m: m in other_units):
        for p in module._parameters.values():
            if p is not None and p not in ignored_params:
                params.setdefault(id(p), p)
    return sorted(params.values(), key=lambda p: not p.requires_grad)
