"""What the guard's scale tests and benchmark count in a rank: the operations a job makes on its store, and the
TCP connections the process holds (tests/test_stalled_waits.py, benchmarks/guard_scale.py)."""

from __future__ import annotations

import os
from typing import Any


def counting_file_store(path: str, world_size: int) -> Any:
    """A ``dist.FileStore`` on ``path`` that counts the operations made on it (``.operations``) and the clients cloned
    from it (``.clones``: the heartbeat's fallback, see [Note: A quiet heartbeat]; a clone is a FileStore on the same
    file, its operations uncounted)."""
    import torch.distributed as dist

    class CountingStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.inner = dist.FileStore(path, world_size)
            self.operations = 0
            self.clones = 0

        def _count(self, name, *args):
            self.operations += 1
            return getattr(self.inner, name)(*args)

        def set(self, key, value):
            return self._count("set", key, value)

        def get(self, key):
            return self._count("get", key)

        def add(self, key, amount):
            return self._count("add", key, amount)

        def check(self, keys):
            return self._count("check", keys)

        def compare_set(self, key, expected, desired):
            return self._count("compare_set", key, expected, desired)

        def delete_key(self, key):
            return self._count("delete_key", key)

        def num_keys(self):
            return self._count("num_keys")

        def multi_get(self, keys):
            return self._count("multi_get", keys)

        def multi_set(self, keys, values):
            return self._count("multi_set", keys, values)

        def wait(self, keys, timeout=None):
            return self._count("wait", keys) if timeout is None else self._count("wait", keys, timeout)

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

        def clone(self):
            self.clones += 1
            return self.inner.clone()

    return CountingStore()


def established_tcp_connections() -> int:
    """This process's established TCP connections (its sockets' inodes in the kernel's tables; Linux)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    established = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            next(f)
            established += sum(1 for line in f if line.split()[3] == "01" and line.split()[9] in inodes)
    return established
