"""Crash-safe checkpoints on top of ``torch.distributed.checkpoint`` (DCP): ``save`` and ``load``.

[Note: Crash-safe saves]
``dcp.save`` into an existing directory overwrites its files in place, so a process
killed mid-save (preemption, an OOM kill) or a full disk destroys the previous good
checkpoint at that path; ``torch.save`` truncates the file first, the same way.
``save(state, path)`` never writes into ``path``:
1. every rank writes through DCP (``FileSystemWriter``, files fsynced) into a
   temporary directory beside it, ``.<name>.flatshard-tmp-<token>``: same
   filesystem, so the moves below are renames;
2. rank 0 writes the completion record ``.flatshard-complete`` (every file's size),
   fsyncs it and the directory;
3. rank 0 moves the directory into place: a plain rename when ``path`` does not
   exist, else an atomic exchange of the two directories (Linux ``renameat2``
   with ``RENAME_EXCHANGE``) and the old one is deleted. Where the filesystem has
   no exchange, ``path`` is first renamed to ``.<name>.flatshard-old-<token>`` and
   ``load`` falls back to that if a crash came between the two renames;
4. the parent directory is fsynced, and every rank learns the outcome.
A failure before step 3 (a killed rank, ENOSPC) leaves ``path`` as it was; the
temporary directory is removed when the failure is a Python exception, and by the
next successful save of the same path otherwise. ``load`` refuses a directory whose
completion record is missing or whose files do not match it, naming what is wrong.
A DCP directory that another writer completed (it has ``.metadata``, which DCP writes
last) loads too. ``keep_last=N`` keeps the N newest complete checkpoints of a series
(sibling directories whose names differ only in trailing digits, e.g. ``step_100``,
``step_200``) and deletes the older ones.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import time
import uuid
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["load", "save"]

COMPLETE_RECORD = ".flatshard-complete"
_TMP_TAG = ".flatshard-tmp-"
_OLD_TAG = ".flatshard-old-"


def save(state: dict[str, Any], path: str | os.PathLike, *, keep_last: int | None = None,
         process_group: dist.ProcessGroup | None = None) -> str:
    """Saves ``state`` (as for ``dcp.save``) to the directory ``path`` so that a crash or a full disk
    mid-save leaves the previous checkpoint at ``path`` intact (see [Note: Crash-safe saves]).

    Collective over ``process_group`` (default: the default group): every rank calls it with
    the same ``path``. Returns the absolute path. Raises on every rank if any rank failed.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"flatshard.checkpoint.save: keep_last must be at least 1, got {keep_last}")
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    token = _from_rank0(process_group, lambda: f"{uuid.uuid4().hex[:12]}")
    tmp = os.path.join(parent, f".{name}{_TMP_TAG}{token}")
    error = _from_rank0(process_group, lambda: _try(lambda: os.makedirs(tmp)))
    if error:
        raise OSError(f"flatshard.checkpoint.save: could not create {tmp}: {error}")
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=process_group)
    except BaseException as e:
        if _rank(process_group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointException):  # a BaseException: as an ordinary error, naming the ranks
            raise _failed("save", path, e, "; the previous checkpoint there, if any, is intact") from e
        raise
    error = _from_rank0(process_group, lambda: _try(lambda: _commit(tmp, path, token, keep_last)))
    if error:
        raise OSError(f"flatshard.checkpoint.save: writing {path} failed on rank 0 after every rank saved: "
                      f"{error}; the previous checkpoint there, if any, is intact.")
    return path


def load(state: dict[str, Any], path: str | os.PathLike, *,
         process_group: dist.ProcessGroup | None = None) -> None:
    """Loads the checkpoint at ``path`` into ``state`` in place (as ``dcp.load``), after checking that
    it is complete (see [Note: Crash-safe saves]). Collective; raises the same error on every rank."""
    path = os.path.abspath(os.fspath(path))
    found = _from_rank0(process_group, lambda: _try(lambda: _complete_directory(path), value=True))
    if isinstance(found, str) and found.startswith("error: "):
        raise ValueError(f"flatshard.checkpoint.load: {found[len('error: '):]}")
    if found != path and _rank(process_group) == 0:
        warnings.warn(f"flatshard.checkpoint.load: {path} is missing; loading {found}, the checkpoint a "
                      f"save interrupted between its two renames had moved aside.", stacklevel=2)
    try:
        dcp.load(state, checkpoint_id=found, process_group=process_group)
    except CheckpointException as e:
        raise _failed("load", found, e, "") from e


def _failed(what: str, path: str, e: CheckpointException, after: str) -> Exception:
    """DCP's CheckpointException (a BaseException) as an OSError where a rank's error was one (ENOSPC...)."""
    causes = {rank: failure[0] for rank, failure in e.failures.items()}
    text = "; ".join(f"rank {rank}: {type(c).__name__}: {c}" for rank, c in sorted(causes.items()))
    message = f"flatshard.checkpoint.{what}: {path} failed on rank(s) {sorted(causes)} ({text}){after}"
    os_errors = [c for c in causes.values() if isinstance(c, OSError)]
    return OSError(os_errors[0].errno, message) if os_errors else RuntimeError(message)


def _commit(tmp: str, path: str, token: str, keep_last: int | None) -> None:
    files = {}
    for entry in sorted(os.listdir(tmp)):
        full = os.path.join(tmp, entry)
        _fsync_file(full)
        files[entry] = os.path.getsize(full)
    record = os.path.join(tmp, COMPLETE_RECORD)
    with open(record + ".part", "w") as f:
        json.dump({"version": 1, "saved_at": time.time(), "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(record + ".part", record)
    _fsync_dir(tmp)
    parent, name = os.path.split(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the old checkpoint
    else:
        old = os.path.join(parent, f".{name}{_OLD_TAG}{token}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    _fsync_dir(parent)
    for entry in os.listdir(parent):  # what earlier interrupted saves of this path left
        if entry.startswith(f".{name}{_TMP_TAG}") or entry.startswith(f".{name}{_OLD_TAG}"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    if keep_last is not None:
        _delete_older(parent, name, keep_last)


def _delete_older(parent: str, name: str, keep_last: int) -> None:
    series = re.sub(r"\d+$", "", name)
    saved = []
    for entry in os.listdir(parent):
        record = os.path.join(parent, entry, COMPLETE_RECORD)
        if entry.startswith(".") or re.sub(r"\d+$", "", entry) != series or not os.path.isfile(record):
            continue
        try:
            with open(record) as f:
                saved.append((json.load(f)["saved_at"], entry))
        except (OSError, ValueError, KeyError):
            continue
    for _, entry in sorted(saved, reverse=True)[keep_last:]:
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    _fsync_dir(parent)


def _complete_directory(path: str) -> str:
    """``path``, or the checkpoint an interrupted save moved aside; raises if neither is complete."""
    if not os.path.isdir(path):
        parent, name = os.path.split(path)
        aside = [os.path.join(parent, e) for e in os.listdir(parent) if e.startswith(f".{name}{_OLD_TAG}")] \
            if os.path.isdir(parent) else []
        for candidate in aside:
            if _problem(candidate) is None:
                return candidate
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    problem = _problem(path)
    if problem is not None:
        raise ValueError(f"{path} is not a complete checkpoint: {problem}")
    return path


def _problem(directory: str) -> str | None:
    record = os.path.join(directory, COMPLETE_RECORD)
    if not os.path.exists(record):
        if os.path.exists(os.path.join(directory, ".metadata")):
            return None  # completed by another DCP writer
        return ("it has neither flatshard's completion record nor DCP's .metadata: a save into it was "
                "interrupted; load an earlier checkpoint")
    try:
        with open(record) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its completion record {record} is unreadable ({e})"
    for entry, size in files.items():
        full = os.path.join(directory, entry)
        if not os.path.exists(full):
            return f"{entry} is missing"
        if os.path.getsize(full) != size:
            return f"{entry} has {os.path.getsize(full)} bytes but was saved with {size}"
    return None


def _exchange(a: str, b: str) -> bool:
    """Swaps two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a directory
        pass
    finally:
        os.close(fd)


def _try(fn: Any, value: bool = False) -> Any:
    """``fn()``'s result (with ``value``) or None; an exception as ``"error: <text>"`` (with ``value``)
    or its text: something rank 0 can send to every rank."""
    try:
        result = fn()
        return result if value else None
    except Exception as e:  # noqa: BLE001 (sent to every rank, which raises)
        text = f"{type(e).__name__}: {e}"
        return f"error: {text}" if value else text


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _from_rank0(group: dist.ProcessGroup | None, fn: Any) -> Any:
    """``fn()`` run on the group's first rank, its result on every rank."""
    if not dist.is_initialized():
        return fn()
    box = [fn() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]
