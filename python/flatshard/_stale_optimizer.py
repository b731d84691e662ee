"""An optimizer built before wrapping: an error at its first step, not training that does nothing.

[Note: An optimizer built before wrapping]
``opt = AdamW(model.parameters()); model = FSDP(model)`` gives the optimizer the original
parameters. With ``use_orig_params=False`` wrapping replaces them by each unit's flat
parameter: the optimizer steps tensors the model no longer uses, and nothing trains, with
no error (torch's FSDP1 behaves the same). So the original parameters a unit flattened away
are marked (``REPLACED_ATTR``: the unit's name and the parameter's), and a global
optimizer step pre-hook (installed with the first such unit) checks each optimizer once, at
its first step: if it holds any of them, the step raises, naming them and the fix. With
``use_orig_params=True`` the original parameters stay the model's, and an optimizer built
before wrapping trains as it would after. The check costs one look-up per step once an
optimizer passed it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

REPLACED_ATTR = "_flatshard_replaced_by"  # (unit name, parameter name) on an original parameter flattened away

_lock = threading.Lock()
_installed = False
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def install() -> None:
    """Registers the check (once per process)."""
    global _installed
    with _lock:
        if not _installed:
            register_optimizer_step_pre_hook(_check)
            _installed = True


def _check(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    if optimizer in _checked:
        return
    stale = [getattr(p, REPLACED_ATTR) for group in optimizer.param_groups for p in group["params"]
             if getattr(p, REPLACED_ATTR, None) is not None]
    if stale:
        unit, name = stale[0]
        raise ValueError(
            f"{type(optimizer).__name__}.step(): the optimizer holds {len(stale)} parameter(s) that "
            f"FullyShardedDataParallel replaced by flat parameters (e.g. '{name}' of unit '{unit or '<root>'}'): it was "
            f"built before wrapping, so its step would train nothing. Build the optimizer after wrapping, from the "
            f"wrapped model (torch.optim.AdamW(model.parameters()) on FSDP(model)), or wrap with "
            f"use_orig_params=True, which keeps the original parameters.")
    _checked.add(optimizer)
