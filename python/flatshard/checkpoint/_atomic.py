"""Crash-safe checkpoints on top of ``torch.distributed.checkpoint`` (DCP): ``save`` and ``load``.

[Note: Crash-safe saves]
``dcp.save`` into an existing directory overwrites its files in place, so a process
killed mid-save (preemption, an OOM kill) or a full disk destroys the previous good
checkpoint at that path; ``torch.save`` truncates the file first, the same way.
``save(state, path)`` never writes into ``path``:
1. rank 0 creates a temporary directory beside it, ``.<name>.flatshard-tmp-<token>``
   (same filesystem, so the moves below are renames; it records its writer, host
   and pid), and every rank uses rank 0's absolute paths;
2. every rank writes through DCP (``FileSystemWriter``, files fsynced) into it, then
   reports the files it sees there: rank 0 must see the same ones, and every file
   DCP's ``.metadata`` refers to (a checkpoint directory on a disk that is not
   shared would otherwise be committed without the other ranks' files);
3. rank 0 writes the completion record ``.flatshard-complete`` (every file's size),
   fsyncs it, the files and the directory;
4. rank 0 moves the directory into place: a plain rename when ``path`` does not
   exist, else an atomic exchange of the two directories (Linux ``renameat2``
   with ``RENAME_EXCHANGE``). Where the filesystem has no exchange (NFS, Lustre,
   FUSE), ``path`` is first renamed to ``.<name>.flatshard-old-<token>``, and
   ``load`` falls back to that if a crash came between the two renames;
5. the parent directory is fsynced and every rank learns the outcome; only then
   does rank 0 delete the old checkpoint (renamed aside first, so a kill
   mid-delete leaves nothing half-deleted in view).
A failure before step 4 (a killed rank, ENOSPC) leaves ``path`` as it was; the
temporary directory is removed when the failure is a Python exception, and by the
next save of the same path once its writer is gone (a dead pid on the same host, or
a day old) otherwise. ``load`` refuses a directory whose completion record is missing
or whose files do not match it, naming what is wrong (FileNotFoundError where there
is none). A DCP directory that another writer completed (``.metadata``, which DCP
writes last, and every file it refers to) loads too. ``keep_last=N`` keeps the N
newest complete checkpoints of a series (sibling directories named with a step
number after ``_``, ``-`` or ``.``: ``step_100``, ``step_200``) and deletes the older ones.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import socket
import time
import uuid
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from flatshard._profiling import collective_range

__all__ = ["load", "save"]

COMPLETE_RECORD = ".flatshard-complete"
_OWNER = ".flatshard-owner"
_TMP_TAG = ".flatshard-tmp-"
_OLD_TAG = ".flatshard-old-"


def save(state: dict[str, Any], path: str | os.PathLike, *, keep_last: int | None = None,
         process_group: dist.ProcessGroup | None = None) -> str:
    """Saves ``state`` (as for ``dcp.save``) to the directory ``path`` so that a crash or a full disk
    mid-save leaves the previous checkpoint at ``path`` intact (see [Note: Crash-safe saves]).

    Collective over ``process_group`` (default: the default group): every rank calls it with
    the same ``path``, on a filesystem every rank shares; rank 0's absolute path is used.
    Returns it. Raises on every rank if any rank failed.
    """
    path, tmp = _from_rank0(process_group, lambda: _outcome(lambda: _prepare(os.fspath(path), keep_last)))
    try:
        with collective_range("checkpoint save (torch.distributed.checkpoint)"):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=process_group)
        error = None
    except CheckpointException as e:  # a BaseException: as an ordinary error, naming the ranks
        error = _failed("save", path, e, "; the previous checkpoint there, if any, is intact")
    if error is not None:
        if _rank(process_group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error
    # What each rank wrote, as it sees the directory: rank 0 must see the same (a shared filesystem).
    seen = _listing(tmp)
    everyone = [seen] if not dist.is_initialized() else [None] * dist.get_world_size(process_group)
    if dist.is_initialized():
        with collective_range("checkpoint save all_gather_object (files written)"):
            dist.all_gather_object(everyone, seen, group=process_group)
    _from_rank0(process_group, lambda: _outcome(lambda: _commit(tmp, path, everyone)))
    if _rank(process_group) == 0:  # after every rank learned the outcome: nothing below can lose data
        _tidy(path, keep_last)
    return path


def load(state: dict[str, Any], path: str | os.PathLike, *,
         process_group: dist.ProcessGroup | None = None) -> None:
    """Loads the checkpoint at ``path`` into ``state`` in place (as ``dcp.load``), after checking that
    it is complete (see [Note: Crash-safe saves]). Collective; raises the same error on every rank:
    FileNotFoundError where there is no checkpoint, ValueError where it is incomplete."""
    path = os.path.abspath(os.fspath(path))
    found = _from_rank0(process_group, lambda: _outcome(lambda: _complete_directory(path)))
    if found != path and _rank(process_group) == 0:
        warnings.warn(f"flatshard.checkpoint.load: {path} is missing; loading {found}, the checkpoint a "
                      f"save interrupted between its two renames had moved aside.", stacklevel=2)
    try:
        with collective_range("checkpoint load (torch.distributed.checkpoint)"):
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


def _prepare(path: str, keep_last: int | None) -> tuple[str, str]:
    """Rank 0: checks ``path`` and creates the temporary directory beside it."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if keep_last is not None:
        if keep_last < 1:
            raise ValueError(f"flatshard.checkpoint.save: keep_last must be at least 1, got {keep_last}")
        if _series(name) is None:
            raise ValueError(f"flatshard.checkpoint.save: keep_last keeps the newest of a series of checkpoints "
                             f"named with a step number after '_', '-' or '.' (e.g. ckpt/step_1000), but the "
                             f"path's name is {name!r}.")
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        raise ValueError(f"flatshard.checkpoint.save: {path} exists and is not a directory (a symlink or a "
                         f"file); save to a directory path (it is replaced whole by the new checkpoint).")
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}{_TMP_TAG}{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    with open(os.path.join(tmp, _OWNER), "w") as f:  # who is writing it (see _abandoned)
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    return path, tmp


def _commit(tmp: str, path: str, everyone: list[dict[str, int]]) -> None:
    """Rank 0: checks the directory, records it complete, durably, and moves it into place."""
    mine = _listing(tmp)
    for rank, theirs in enumerate(everyone):
        for entry, size in theirs.items():
            if mine.get(entry) != size:
                raise OSError(errno.EIO, f"flatshard.checkpoint.save: rank {rank} wrote {entry} ({size} bytes) "
                                         f"into {tmp}, which rank 0 sees as {mine.get(entry, 'missing')}: the "
                                         f"checkpoint directory must be on a filesystem every rank shares; "
                                         f"the previous checkpoint at {path}, if any, is intact.")
    missing = _unreferenced_files(tmp)
    if missing:
        raise OSError(errno.EIO, f"flatshard.checkpoint.save: {tmp} lacks {missing[:3]}, which its .metadata "
                                 f"refers to; the previous checkpoint at {path}, if any, is intact.")
    files = {}
    for entry in sorted(mine):
        _fsync_file(os.path.join(tmp, entry))
        files[entry] = mine[entry]
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
    elif not _exchange(tmp, path):  # (else the old checkpoint is now at tmp, for _tidy)
        old = os.path.join(parent, f".{name}{_OLD_TAG}{tmp.rsplit(_TMP_TAG, 1)[1]}")
        os.rename(path, old)
        os.rename(tmp, path)
    _fsync_dir(parent)


def _tidy(path: str, keep_last: int | None) -> None:
    """Rank 0, after the commit: removes what is no longer a checkpoint (best effort)."""
    parent, name = os.path.split(path)
    names = {name}
    if keep_last is not None:
        names |= _delete_older(parent, name, keep_last)
    for entry in os.listdir(parent):  # the old checkpoint, and what interrupted saves of these paths left
        for n in names:
            full = os.path.join(parent, entry)
            if entry.startswith(f".{n}{_OLD_TAG}") or (entry.startswith(f".{n}{_TMP_TAG}") and _abandoned(full)):
                _remove(full)
    _fsync_dir(parent)


def _series(name: str) -> str | None:
    """``step_`` for ``step_1000``: the name without its step number; None without one."""
    match = re.fullmatch(r"(.*[_.\-])\d+", name)
    return match.group(1) if match else None


def _delete_older(parent: str, name: str, keep_last: int) -> set[str]:
    """Deletes the complete checkpoints of ``name``'s series but the newest ``keep_last``; returns the
    series' names."""
    series = _series(name)
    saved, names = [], set()
    for entry in os.listdir(parent):
        if entry.startswith(".") or _series(entry) != series:
            continue
        names.add(entry)
        try:
            with open(os.path.join(parent, entry, COMPLETE_RECORD)) as f:
                saved.append((json.load(f)["saved_at"], entry))
        except (OSError, ValueError, KeyError):
            continue  # not one flatshard completed: not ours to delete
    for _, entry in sorted(saved, reverse=True)[keep_last:]:
        _remove(os.path.join(parent, entry))
    return names


def _remove(directory: str) -> None:
    """Deletes a directory; first renamed aside, so that a kill mid-delete leaves nothing half-deleted in view."""
    parent, name = os.path.split(directory)
    doomed = directory if name.startswith(".") else os.path.join(parent, f".{name}{_OLD_TAG}{uuid.uuid4().hex[:12]}")
    try:
        if doomed != directory:
            os.rename(directory, doomed)
        shutil.rmtree(doomed)
    except OSError:
        pass


def _abandoned(tmp: str) -> bool:
    """Whether an interrupted save's directory is no longer being written: its writer's process is
    gone (same host), or it is older than a day (another host)."""
    try:
        with open(os.path.join(tmp, _OWNER)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        owner = {}
    if owner.get("host") == socket.gethostname():
        try:
            os.kill(int(owner["pid"]), 0)
            return False
        except (ProcessLookupError, KeyError, ValueError):
            return True
        except PermissionError:
            return False
    try:
        return time.time() - os.path.getmtime(tmp) > 24 * 3600
    except OSError:
        return False


def _listing(directory: str) -> dict[str, int]:
    return {e: os.path.getsize(os.path.join(directory, e)) for e in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, e))}


def _unreferenced_files(directory: str) -> list[str]:
    """The files the directory's DCP .metadata refers to that it lacks."""
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001
        return [f".metadata ({type(e).__name__}: {e})"]
    wanted = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    return sorted(w for w in wanted if w and not os.path.exists(os.path.join(directory, w)))


def _complete_directory(path: str) -> str:
    """``path``, or the checkpoint an interrupted save moved aside; raises if neither is complete."""
    if not os.path.isdir(path):
        parent, name = os.path.split(path)
        aside = [os.path.join(parent, e) for e in os.listdir(parent) if e.startswith(f".{name}{_OLD_TAG}")] \
            if os.path.isdir(parent) else []
        for candidate in aside:
            if _problem(candidate) is None:
                return candidate
        raise FileNotFoundError(errno.ENOENT, f"flatshard.checkpoint.load: no checkpoint directory at {path}")
    problem = _problem(path)
    if problem is not None:
        raise ValueError(f"flatshard.checkpoint.load: {path} is not a complete checkpoint: {problem}")
    return path


def _problem(directory: str) -> str | None:
    record = os.path.join(directory, COMPLETE_RECORD)
    if not os.path.exists(record):
        if os.path.exists(os.path.join(directory, ".metadata")):
            missing = _unreferenced_files(directory)  # completed by another DCP writer
            return f"it lacks {missing[:3]}, which its .metadata refers to" if missing else None
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


def _outcome(fn: Any) -> tuple[str, Any]:
    """``fn()`` as something rank 0 can send to every rank: ("ok", result) or (exception type, errno, text)."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 (sent to every rank, which raises it again)
        return (type(e).__name__, (getattr(e, "errno", None), e.strerror if isinstance(e, OSError) and e.strerror
                                   else str(e)))


def _raise_or_return(outcome: tuple[str, Any]) -> Any:
    kind, value = outcome
    if kind == "ok":
        return value
    code, text = value
    if kind in ("FileNotFoundError", "OSError", "PermissionError") or code is not None:
        cls = {"FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError}.get(kind, OSError)
        raise cls(code, text) if code is not None else cls(text)
    raise (ValueError if kind == "ValueError" else RuntimeError)(text)


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _from_rank0(group: dist.ProcessGroup | None, fn: Any) -> Any:
    """``fn()`` (an ``_outcome``) run on the group's first rank; on every rank its result, or its error raised."""
    if not dist.is_initialized():
        return _raise_or_return(fn())
    box = [fn() if dist.get_rank(group) == 0 else None]
    with collective_range("checkpoint broadcast_object_list (rank 0's outcome)"):
        dist.broadcast_object_list(box, group_src=0, group=group)
    return _raise_or_return(box[0])
