"""The malloc counter of the memory tests (tests/memcount/malloc_peak.c): built once, preloaded into a process.

[Note: Measuring memory on a CPU]
A CPU has no allocator statistics like CUDA's ``max_memory_allocated``. glibc's ``mallinfo2``
says what is in use now, but sampled after each torch op it misses what lives only inside
one call (gloo's all-gather writes a flat copy of its output on its own thread and frees it
before the call returns). So the memory tests preload a counter into the process
(``LD_PRELOAD``): it wraps malloc, free and their kin, adds up every thread's blocks and keeps
the highest total since the last reset. Python's small objects come from its own arenas and
are not counted; torch's tensors, gloo's buffers and autograd's nodes are. ``library()`` builds
it with the C compiler that builds flatshard (cached per source hash); ``preloaded_env()`` is
the environment for a subprocess; ``MallocCounter`` reads it inside that process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memcount", "malloc_peak.c")


def library() -> str:
    """The counter's shared library, compiled on first use (``cc``) into the temporary directory."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"flatshard_malloc_peak_{digest}.so")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}"
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", partial, SOURCE], check=True)
        os.replace(partial, path)
    return path


def preloaded_env() -> dict[str, str]:
    return {**os.environ, "LD_PRELOAD": library()}


class MallocCounter:
    """The preloaded counter, read from inside the process (raises if it is not preloaded)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)
        try:
            self._in_use, self._peak = lib.flatshard_memcount_in_use, lib.flatshard_memcount_peak
        except AttributeError:
            raise RuntimeError(f"the malloc counter is not preloaded: run with LD_PRELOAD={library()}") from None
        self._in_use.restype = self._peak.restype = ctypes.c_longlong
        self._reset = lib.flatshard_memcount_reset_peak

    def in_use(self) -> int:
        return self._in_use()

    def peak(self) -> int:
        return self._peak()

    def reset_peak(self) -> None:
        self._reset()
