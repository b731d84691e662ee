"""``flatshard.plan``: what a wrap holds and moves per rank at any world size, before running it.

``flatshard.plan(model, world_size, ...)`` (this package is callable: ``_CallablePackage``) returns a ``Plan``;
``python -m flatshard.plan`` plans from an HF config. How: [Note: Planning] in _plan.py. The names below load with
their first use (see [Note: A lazy import] in flatshard/__init__.py): the command line checks its arguments before
torch is imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

_LAZY = {
    "ActivationProfile": "flatshard.plan._activations",
    "measure_activations": "flatshard.plan._activations",
    "profile_activations": "flatshard.plan._activations",
    "INFINIBAND": "flatshard.plan._timing",
    "NVLINK": "flatshard.plan._timing",
    "Network": "flatshard.plan._timing",
    "StepTime": "flatshard.plan._timing",
    "measure_compute": "flatshard.plan._timing",
    "NETWORKS": "flatshard.plan._timing",
    "step_time": "flatshard.plan._timing",
    "Plan": "flatshard.plan._plan",
    "plan": "flatshard.plan._plan",
    "RankMemory": "flatshard.plan._costs",
    "UnitTraffic": "flatshard.plan._costs",
    "rank_memory": "flatshard.plan._costs",
    "unit_traffic": "flatshard.plan._costs",
    "PlannedUnit": "flatshard.plan._units",
    "planned_units": "flatshard.plan._units",
}

_SUBMODULES = ("_activations", "_costs", "_kernel_scratch", "_plan", "_plot", "_timing", "_units")

__all__ = ["INFINIBAND", "NVLINK", "ActivationProfile", "Network", "Plan", "StepTime", "measure_activations",
           "measure_compute", "plan", "profile_activations"]

if TYPE_CHECKING:
    from flatshard.plan._activations import ActivationProfile, measure_activations, profile_activations  # noqa: F401
    from flatshard.plan._plan import Plan, plan  # noqa: F401
    from flatshard.plan._timing import INFINIBAND, NVLINK, Network, StepTime, measure_compute  # noqa: F401


def __getattr__(name: str) -> Any:
    """The names above, and the submodules (``flatshard.plan._costs``), loaded when first used."""
    module = _LAZY.get(name)
    if module is None and (name.startswith("__") or name not in _SUBMODULES):
        raise AttributeError(f"module 'flatshard.plan' has no attribute {name!r}")
    import torch  # noqa: F401  (loads libc10/libtorch before the extension)

    if module is None:
        value = importlib.import_module(f"flatshard.plan.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _CallablePackage(types.ModuleType):
    """``flatshard.plan`` is this package, and calling it plans: ``flatshard.plan(model, 64, ...)``, and
    ``flatshard.plan.measure_activations`` is the package's, whatever was imported first (``import flatshard``
    loads the package only when ``flatshard.plan`` is first used)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return __getattr__("plan")(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
