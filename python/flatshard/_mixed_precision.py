"""Mixed precision and CPU offload: torch's ``MixedPrecision`` and ``CPUOffload`` resolved
per unit, and the casts that happen in Python (forward inputs, buffers).

The casts and copies of parameters and gradients are in C++, on the collective
streams: see [Note: Mixed precision and offload] in csrc/flatshard/flat_param.h.
What each ``MixedPrecision`` field does here is what torch's FSDP1 does with it:
- ``param_dtype``: forward and backward compute in it; the all-gather moves it.
- ``reduce_dtype``: the gradient's dtype for its reduction; defaults to
  ``param_dtype`` when that is given.
- ``keep_low_precision_grads``: ``.grad`` stays in low precision after backward
  (``param_dtype`` for sharded units, the reduction's dtype for NO_SHARD, as
  torch); otherwise it is in the parameters' own dtype.
- ``buffer_dtype``: floating-point buffers are cast to it at the root's first
  forward and stay so; state dicts save them in their original dtype.
- ``cast_forward_inputs`` / ``cast_root_forward_inputs``: floating-point tensors
  in a unit's forward arguments are cast to ``param_dtype`` (the root: when
  either is set; other units: ``cast_forward_inputs``).
- ``_module_classes_to_ignore`` (default: batch norm): with an
  ``auto_wrap_policy``, modules of these classes become units of their own
  without mixed precision; their inputs are cast to float32 and their outputs
  back to the inputs' dtype.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatshard._common import fsdp_modules, map_tensors

if TYPE_CHECKING:
    from flatshard._state import UnitState
from flatshard.api import CPUOffload, MixedPrecision

_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def check_mixed_precision(mixed_precision: Any) -> MixedPrecision | None:
    """torch's ``MixedPrecision`` (or None), validated; a default one means none."""
    if mixed_precision is None:
        return None
    if not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(
            f"FullyShardedDataParallel: mixed_precision: expected a torch.distributed.fsdp.MixedPrecision or "
            f"None but got {mixed_precision!r}"
        )
    for field in _FIELDS:
        dtype = getattr(mixed_precision, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"FullyShardedDataParallel: mixed_precision.{field}: expected a floating-point torch.dtype "
                f"(e.g. torch.bfloat16) or None but got {dtype!r}"
            )
    return mixed_precision


def check_cpu_offload(cpu_offload: Any) -> bool:
    """Whether parameters are offloaded (``CPUOffload(offload_params=True)``)."""
    if cpu_offload is None:
        return False
    if not isinstance(cpu_offload, CPUOffload):
        raise ValueError(
            f"FullyShardedDataParallel: cpu_offload: expected a torch.distributed.fsdp.CPUOffload or None but "
            f"got {cpu_offload!r}"
        )
    return bool(cpu_offload.offload_params)


def flat_param_dtypes(
    mixed_precision: MixedPrecision | None, orig: torch.dtype, replicated: bool, offload: bool, unit_name: str
) -> dict[str, torch.dtype | None]:
    """``param_dtype``, ``reduce_dtype`` and ``grad_dtype`` for ``_C.FlatParamHandle``: each one the mixed
    precision names, also where it equals the parameters' own dtype (so that it stays when the shard is
    cast later, e.g. accelerate's fp32 upcast of a bf16 model); None: the shard's dtype, whatever it is."""
    none = {"param_dtype": None, "reduce_dtype": None, "grad_dtype": None}
    if mixed_precision is None or not (mixed_precision.param_dtype or mixed_precision.reduce_dtype):
        return none
    if not orig.is_floating_point:
        raise ValueError(
            f"FullyShardedDataParallel: unit '{unit_name or '<root>'}' has {orig} parameters, which "
            f"mixed_precision cannot cast. Put the modules holding them in ignored_modules, or wrap them in a "
            f"unit of their own with mixed_precision=None."
        )
    param = mixed_precision.param_dtype
    reduce = mixed_precision.reduce_dtype or mixed_precision.param_dtype
    grad = None
    if mixed_precision.keep_low_precision_grads:
        # As torch: a NO_SHARD unit keeps its reduced gradient as it is (its dtype), others param_dtype.
        grad = reduce if replicated and not offload else param  # (None: follows the shard's dtype)
    return {"param_dtype": param, "reduce_dtype": reduce, "grad_dtype": grad}


def gradient_divide_factors(data_parallel_world_size: int | float) -> tuple[float, float]:
    """(before, after) the SUM: torch FSDP1's split of the average's division.

    Before: the smallest power of two f with f * f >= W that divides W (at most
    W), after: W / f; so that a low-precision SUM neither overflows nor
    underflows. For W a power of two every division is exact.
    """
    factor = 1
    while data_parallel_world_size % factor == 0 and data_parallel_world_size / factor > factor:
        factor *= 2
    return float(factor), data_parallel_world_size / factor


def forward_input_dtype(mixed_precision: MixedPrecision | None, is_root: bool) -> torch.dtype | None:
    """The dtype a unit casts its forward inputs to, or None."""
    if mixed_precision is None or mixed_precision.param_dtype is None:
        return None
    cast = mixed_precision.cast_forward_inputs or (is_root and mixed_precision.cast_root_forward_inputs)
    return mixed_precision.param_dtype if cast else None


def cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """``obj`` with every floating-point tensor in it cast to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(cast, obj)


def cast_buffers(s: UnitState, unit_modules: list[tuple[str, nn.Module]]) -> None:
    """At the root's lazy init: the unit's floating-point buffers to ``buffer_dtype``, remembering
    each one's original dtype for state dicts (``buffer_orig_dtypes``: (module, name) -> dtype).
    Safe to call twice (a lazy init undone by ``apply`` runs again)."""
    mp = s.config.mixed_precision
    if mp is None or mp.buffer_dtype is None:
        return
    for _, m in unit_modules:
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != mp.buffer_dtype:
                s.buffer_orig_dtypes.setdefault((m, name), b.dtype)
                # In place, as torch: a buffer shared by several modules stays one tensor.
                b.data = b.data.to(mp.buffer_dtype)


def original_buffer_dtypes(root: nn.Module) -> dict[int, torch.dtype]:
    """id(buffer) -> original dtype, for every buffer a unit in ``root`` cast to ``buffer_dtype``."""
    out = {}
    for unit in fsdp_modules(root):
        for (m, name), dtype in unit._unit_state.buffer_orig_dtypes.items():
            b = m._buffers.get(name)
            if b is not None:
                out[id(b)] = dtype
    return out


def individually_wrapped(mixed_precision: MixedPrecision | None) -> tuple[type, ...]:
    """Classes that auto-wrap makes units of their own without mixed precision (see the module note)."""
    if mixed_precision is None:
        return ()
    return tuple(set(mixed_precision._module_classes_to_ignore))


def run_in_fp32(modules: list[nn.Module]) -> None:
    """The modules auto-wrap made fp32 units of (see ``individually_wrapped``): their inputs are cast
    to float32 and outputs back; warns, as torch does."""
    found = set()
    for m in modules:
        if not getattr(m, "_flatshard_fp32_hooks", False):
            _register_fp32_casts(m)
        found.add(type(m))
    if found:
        warnings.warn(
            f"FullyShardedDataParallel: both mixed_precision and an auto_wrap_policy were given: modules of "
            f"{sorted(c.__name__ for c in found)} (mixed_precision._module_classes_to_ignore) are wrapped in "
            f"units of their own that run in float32, as torch's FSDP does.",
            stacklevel=4,
        )


def _register_fp32_casts(module: nn.Module) -> None:
    seen: dict[str, torch.dtype] = {}

    def to_fp32(_module: nn.Module, args: Any) -> Any:
        def cast(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point() or t.dtype == torch.float32:
                return t
            seen["dtype"] = t.dtype
            return t.float()

        seen.clear()
        return map_tensors(cast, args)

    def back(_module: nn.Module, _args: Any, output: Any) -> Any:
        if "dtype" not in seen:
            return output
        dtype = seen["dtype"]
        return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    module.register_forward_pre_hook(to_fp32)
    module.register_forward_hook(back)
    module._flatshard_fp32_hooks = True
