"""Profiler ranges for the collectives flatshard issues from Python.

Every collective, the C++ runtime's and these alike, runs inside a ``torch.profiler``
range named ``flatshard::<what> <unit>`` (see DESIGN.md's contracts), so that a trace
shows which part of flatshard issued it and for which unit. The C++ scheduler names its
own (csrc/flatshard/flat_param.h); the ones issued from Python (clip_grad_norm_, state
dicts, optimizer state dicts, summon_full_params, sync_module_states, the rank guard,
checkpoint saves) take theirs from ``collective_range``.
"""

from __future__ import annotations

from torch.autograd.profiler import record_function


def collective_range(what: str, unit: str | None = None) -> record_function:
    """The range ``flatshard::<what>`` (`` <unit>`` appended when given: "" is the root)."""
    return record_function(f"flatshard::{what}" if unit is None else f"flatshard::{what} {unit or '<root>'}")
