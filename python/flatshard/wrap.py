"""Auto-wrap policies: which submodules become their own FSDP units.

Our policies have the signatures of torch's (``torch.distributed.fsdp.wrap``),
and ``FullyShardedDataParallel`` accepts torch's own policy objects and
``functools.partial`` s of torch's policy functions as well: every kind is
turned into one plan, the modules to wrap in post-order, by ``_plan_wraps``.
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Iterable

import torch.distributed.fsdp.wrap as _torch_wrap
from torch import nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]


class ModuleWrapPolicy:
    """Wrap every module that is an instance of one of ``module_classes``."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self._module_classes = frozenset(module_classes)

    def __repr__(self) -> str:
        names = sorted(c.__name__ for c in self._module_classes)
        return f"ModuleWrapPolicy({{{', '.join(names)}}})"


class CustomPolicy:
    """Wrap every module for which ``lambda_fn(module)`` is truthy.

    A dict result wraps the module with those constructor arguments overriding
    the root's (e.g. ``{"sharding_strategy": ShardingStrategy.NO_SHARD}``).
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]):
        self._lambda_fn = lambda_fn


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap a module when ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (e.g. a transformer block)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once the parameters not yet wrapped below it reach ``min_num_params``.

    ``force_leaf_modules`` are not recursed into (default ``nn.MultiheadAttention``);
    ``exclude_wrap_modules`` are never wrapped (default ``nn.ModuleList``, ``nn.ModuleDict``).
    """
    leaves = tuple(force_leaf_modules if force_leaf_modules is not None else {nn.MultiheadAttention})
    excluded = tuple(
        exclude_wrap_modules if exclude_wrap_modules is not None else {nn.ModuleList, nn.ModuleDict}
    )
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, excluded)


size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]


def _plan_wraps(
    root: nn.Module,
    policy: Any,
    ignored_modules: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
    is_unit: Callable[[nn.Module], bool],
    individually: tuple[type[nn.Module], ...] = (),
) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The modules below ``root`` to wrap, innermost first, with their argument overrides.

    ``root`` itself is never in the plan (the caller wraps it). Subtrees of
    ignored modules and of existing units (``is_unit``) are not entered.
    Modules of the ``individually`` classes are wrapped too, without mixed
    precision (``mixed_precision._module_classes_to_ignore``, as torch's FSDP1:
    with them the callable protocol also recurses everywhere).
    """
    no_mp = {"mixed_precision": None}

    def alone(module: nn.Module) -> bool:
        return bool(individually) and isinstance(module, individually)

    def children(module: nn.Module):
        return [c for c in module.children() if c not in ignored_modules and not is_unit(c)]

    def post_order(module: nn.Module):
        for child in children(module):
            yield from post_order(child)
        yield module

    if isinstance(policy, (ModuleWrapPolicy, _torch_wrap.ModuleWrapPolicy)):
        classes = tuple(policy._module_classes)
        return [(m, dict(no_mp) if alone(m) else {}) for m in post_order(root)
                if m is not root and (isinstance(m, classes) or alone(m))]
    if isinstance(policy, (CustomPolicy, _torch_wrap.CustomPolicy)):
        plan = []
        for m in post_order(root):
            if m is root:
                continue
            result = policy._lambda_fn(m)
            if isinstance(result, dict):
                plan.append((m, {**result, **no_mp} if alone(m) else dict(result)))
            elif result or alone(m):
                plan.append((m, dict(no_mp) if alone(m) else {}))
        return plan
    if not callable(policy):
        raise ValueError(
            f"auto_wrap_policy: expected a ModuleWrapPolicy, a CustomPolicy or a callable "
            f"(module, recurse, nonwrapped_numel) -> bool but got {policy!r}"
        )
    return _plan_callable(root, policy, ignored_params, children, alone, bool(individually), no_mp)


def _plan_callable(root: nn.Module, policy: Callable, ignored_params: AbstractSet[nn.Parameter],
                   children: Callable[[nn.Module], list[nn.Module]], alone: Callable[[nn.Module], bool],
                   any_alone: bool, no_mp: dict[str, Any]) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The callable protocol: policy(module, recurse=True, ...) says whether to look inside,
    policy(module, recurse=False, nonwrapped_numel=n) whether to wrap, n counting the parameters not
    already wrapped below it."""
    plan: list[tuple[nn.Module, dict[str, Any]]] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if not any_alone and not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in children(module))
        if not is_root and (alone(module) or policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped)):
            plan.append((module, dict(no_mp) if alone(module) else {}))
            return numel
        return wrapped

    visit(root, True)
    return plan
