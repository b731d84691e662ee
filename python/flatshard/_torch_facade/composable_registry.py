"""torch's registry of composable distributed APIs, as flatshard's fully_shard modules take part in it.

[Note: Composing with torch's replicate]
torch's composable APIs record themselves in a registry in each module's ``__dict__`` (``_get_registry``), which the
others read: torch's ``replicate`` (DDP) leaves the parameters of a module marked ``fully_shard`` to it, and
``fully_shard`` leaves those of a module marked ``replicate`` to DDP. flatshard's ``fully_shard`` marks its modules so
(``mark``: torch's ``fully_shard`` applied to one again then raises torch's "can only be applied to a module once"),
and takes the parameters under a module marked ``replicate`` for ignored parameters (``with_replicated_params``).
tests/test_fully_shard_compose.py runs torch's four compositions against torch's FSDP2.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry


def mark(module: nn.Module) -> None:
    """``module`` marked ``fully_shard`` in torch's registry (see the Note)."""
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())


def with_replicated_params(modules: list[nn.Module], ignored_params: Any) -> Any:
    """``ignored_params`` and every parameter under a module torch's ``replicate`` manages (see the Note)."""
    replicated = {id(p): p for m in modules for sub in m.modules()
                  if "replicate" in (_get_registry(sub) or ()) for p in sub.parameters()}
    if not replicated:
        return ignored_params
    return set(ignored_params or ()) | set(replicated.values())
