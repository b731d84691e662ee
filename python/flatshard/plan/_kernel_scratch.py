"""What a CPU kernel allocates besides its tensors, for the activation profile.

[Note: Kernel scratch on a CPU]
torch's profiler sees tensors only. Some CPU kernels allocate working memory of their own with
``malloc``: on a CPU without AVX512-BF16, a bf16 matrix product with a transposed operand (the
weight gradient of every ``nn.Linear``) accumulates into a float32 buffer the size of its output
(262 KB for a 512 x 128 weight), twice the bf16 output the profiler records. A plan built from
the profiler alone misses it at every unit's backward: 11% of the tests' GPT's peak per rank in
bf16 at W = 64, on such a CPU (none on one with AVX512-BF16, whose kernel works in place).

So on a CPU the profile's warm-up step runs under a dispatch mode that measures, once per
distinct call (the operator, its tensors' shapes, strides and dtypes, its other arguments), what
the call holds beyond its new outputs: it runs the call again on the same arguments after
``malloc_trim(0)`` has handed every free page of the heap back to the system, with the process's
peak resident size reset (``/proc/self/clear_refs``), and takes the rise of that peak
(``VmHWM``) over the resident size before it, less the bytes of the outputs it made, the
smallest of up to three tries (the rise only ever errs high: a page Python's allocator
touched; a first try under SCRATCH_FLOOR settles it), once per process (every profile taken in
it agrees). Run again are only calls that cannot change the step or the job: not one that
writes into its arguments or draws random numbers, not a collective (the ``c10d`` namespaces,
or an argument that is a process group or other script object: its peers would never pair it),
not one on sparse or non-CPU tensors; the random number generator's state is put back after
the tries all the same. A call that fails to run again, or a /proc that refuses the reset,
measures nothing. The profiled step then marks, after each call whose scratch is at least
SCRATCH_FLOOR, the bytes it held: the profile counts them on top of what is live there, for
that moment (and, scratch being host memory, does not scale them by ``host_scale``). Nothing
is measured on a GPU (the caching allocator's workspaces are tensors to the profiler), where
glibc or /proc is missing, or with ``kernel_scratch=False`` (the CLI's: its CPU stands in for the
GPUs its plan is for, whose kernels are others). The reset also resets the process's ``getrusage`` maximum resident
size (``ru_maxrss``): such a peak read across a profile on a CPU counts from its last reset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MARK = "flatshard.plan.scratch:"
# Below this a measured rise is the measurement's own noise (a few pages of Python's objects): not scratch.
SCRATCH_FLOOR = 32 * 1024
_TRIES = 3
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
# Measured per distinct call, once per process: every profile taken in a process agrees on a kernel's scratch.
_MEASURED: dict[Any, int] = {}


@functools.cache
def glibc() -> Any | None:
    """The C library, where it is glibc (its ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _libc() -> Any | None:
    """glibc, if it is the allocator and /proc/self/clear_refs takes a reset of the peak resident size."""
    libc = glibc()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return libc if libc is not None and _peak_resident() else None
    except OSError:
        return None


def _peak_resident() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _signature(func: Any, args: tuple, kwargs: dict) -> Any:
    """What decides a call's kernel: the operator, the arguments' structure, its tensors' shapes, strides and dtypes,
    its other arguments (typed: 1, 1.0 and True differ), the threads it may use."""
    flat, spec = tree_flatten((args, kwargs))
    key: list[Any] = [str(spec), torch.get_num_threads()]
    for a in flat:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device.type))
        else:
            key.append((type(a).__name__, repr(a)))
    return (func, tuple(key))


def _storages(value: Any) -> dict[int, int]:
    flat, _ = tree_flatten(value)
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat if isinstance(t, torch.Tensor)}


def _rerunnable(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether running ``func`` again on the same arguments can change nothing but memory (see the Note)."""
    schema = func._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    if func.namespace in _COLLECTIVE_NAMESPACES:
        return False
    if any(r.alias_info is not None for r in schema.returns):  # a view: no kernel runs
        return False
    flat, _ = tree_flatten((args, kwargs, out))
    if any(isinstance(a, torch.ScriptObject) for a in flat):  # a process group, a work: a collective's
        return False
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors)


class KernelScratch:
    """The measured scratch per distinct call (see the Note): ``measuring()`` measures every call it sees,
    ``marking()`` marks the measured ones in the profiler's record."""

    def __init__(self) -> None:
        self._libc = _libc()
        self.bytes = _MEASURED

    @property
    def available(self) -> bool:
        return self._libc is not None

    def measuring(self) -> TorchDispatchMode:
        return _Mode(self._measure)

    def marking(self) -> TorchDispatchMode:
        return _Mode(self._mark)

    def _measure(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not _rerunnable(func, args, kwargs, out):
            return
        key = _signature(func, args, kwargs)
        if key in self.bytes:
            return
        try:
            self.bytes[key] = self._held_beside_outputs(func, args, kwargs)
        except Exception:  # noqa: BLE001 (a call that does not run again, a /proc that refuses: nothing measured)
            self.bytes[key] = 0

    def _held_beside_outputs(self, func: Any, args: tuple, kwargs: dict) -> int:
        inputs = _storages((args, kwargs))
        rng = torch.get_rng_state()
        best = None
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                for _ in range(_TRIES):
                    self._libc.malloc_trim(0)
                    before = _resident()
                    clear_refs.write("5")
                    clear_refs.flush()
                    again = func(*args, **kwargs)
                    rise = _peak_resident() - before
                    made = sum(n for ptr, n in _storages(again).items() if ptr not in inputs)
                    del again
                    best = rise - made if best is None else min(best, rise - made)
                    if best < SCRATCH_FLOOR:
                        break
        finally:
            torch.set_rng_state(rng)
        return best if best is not None and best >= SCRATCH_FLOOR else 0

    def _mark(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        held = self.bytes.get(_signature(func, args, kwargs), 0)
        if held:
            with torch.profiler.record_function(f"{MARK}{held}"):
                pass


class _Mode(TorchDispatchMode):
    def __init__(self, after: Callable[[Any, tuple, dict, Any], None]) -> None:
        super().__init__()
        self._after = after

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._after(func, args, kwargs, out)
        return out
