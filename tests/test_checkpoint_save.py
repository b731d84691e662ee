"""Crash-safe checkpoints: flatshard.checkpoint.save / load (see [Note: Crash-safe saves]).

A process killed mid-save (SIGKILL: preemption, the OOM killer) and a full disk (ENOSPC,
simulated by making DCP's file writes fail) must leave the previous checkpoint at the
path intact and loadable; the same kill with a plain ``dcp.save`` to that path destroys
it (the control, which shows the test can see the damage).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flatshard.testing import DistributedTestFailure, run_distributed
from test_sharded_checkpoint import _build, _train

KILL_AFTER_BYTES = 4096


@contextlib.contextmanager
def _failing_writes(rank_to_fail: int, action: str):
    """DCP's file writes on ``rank_to_fail`` die (``kill``) or fail with ENOSPC (``enospc``) after a few KiB."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystem.create_stream

    class Stream:
        def __init__(self, inner):
            self.inner, self.written = inner, 0

        def write(self, data):
            self.written += len(data)
            if self.written > KILL_AFTER_BYTES:
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.inner.write(data)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as inner:
            yield Stream(inner) if "w" in mode and dist.get_rank() == rank_to_fail else inner

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = original


def _weights(FSDP, model) -> dict:
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save(rank, world_size, path, steps, fail=None, plain_dcp=False):
    """Trains ``steps`` steps and saves; with ``fail=(rank, action)`` that rank's writes fail mid-save."""
    from flatshard.checkpoint import get_state_dict, save

    FSDP, model, opt = _build()
    _train(model, opt, range(steps), rank, world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with _failing_writes(*fail) if fail else contextlib.nullcontext():
        if plain_dcp:
            dcp.save(state, checkpoint_id=path)
        else:
            save(state, path)
    return _weights(FSDP, model)


def _load(rank, world_size, path):
    from flatshard.checkpoint import get_state_dict, load, set_state_dict

    FSDP, model, opt = _build(seed=7)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _weights(FSDP, model)


def _assert_same_weights(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    good = run_distributed(_save, 2, path, 2, timeout=120)[0]
    with pytest.raises(DistributedTestFailure, match=r"rank\(s\) \[1\]"):
        run_distributed(_save, 2, path, 4, (1, "kill"), timeout=120)
    leftovers = [e for e in os.listdir(tmp_path) if ".flatshard-tmp-" in e]
    assert leftovers, "the killed save should have been writing beside the checkpoint"
    _assert_same_weights(run_distributed(_load, 2, path, timeout=120)[0], good, "after a SIGKILL mid-save")
    # The next save of the path succeeds and clears what the killed one left.
    newer = run_distributed(_save, 2, path, 3, timeout=120)[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_same_weights(run_distributed(_load, 2, path, timeout=120)[0], newer, "after the next save")


def test_sigkill_mid_plain_dcp_save_destroys_previous_checkpoint(tmp_path):
    """The control: DCP alone, killed the same way, leaves nothing loadable at the path."""
    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2, path, 2, None, True, timeout=120)
    with pytest.raises(DistributedTestFailure):
        run_distributed(_save, 2, path, 4, (1, "kill"), True, timeout=120)
    with pytest.raises(DistributedTestFailure):
        run_distributed(_load, 2, path, timeout=120)


def _save_expecting_enospc(rank, world_size, path):
    with pytest.raises(OSError, match=r"flatshard.checkpoint.save: .*ckpt failed on rank\(s\) \[1\] \(rank 1: "
                                      r"OSError: \[Errno 28\] No space left on device\); the previous checkpoint "
                                      r"there, if any, is intact") as caught:
        _save(rank, world_size, path, 4, (1, "enospc"))
    return caught.value.errno


def test_full_disk_mid_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    good = run_distributed(_save, 2, path, 2, timeout=120)[0]
    raised = run_distributed(_save_expecting_enospc, 2, path, timeout=120)
    assert raised == [errno.ENOSPC, errno.ENOSPC]  # every rank raised, none hung
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "the failed save's temporary directory was left behind"
    _assert_same_weights(run_distributed(_load, 2, path, timeout=120)[0], good, "after ENOSPC mid-save")


def _load_expecting(rank, world_size, path, error, pattern):
    with pytest.raises(error, match=pattern):
        _load(rank, world_size, path)


def test_load_refuses_incomplete_directory(tmp_path):
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"\0" * 100)
    run_distributed(_load_expecting, 1, str(interrupted), ValueError,
                    r"interrupted is not a complete checkpoint: it has neither flatshard's completion record "
                    r"nor DCP's .metadata", timeout=60)
    # A flatshard checkpoint whose data file was truncated afterwards (e.g. a bad copy).
    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2, path, 1, timeout=120)
    data = os.path.join(path, "__1_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    run_distributed(_load_expecting, 2, path, ValueError, r"__1_0.distcp has \d+ bytes but was saved with \d+",
                    timeout=60)
    # None at all: FileNotFoundError (a resume script's "start fresh" case), on every rank.
    run_distributed(_load_expecting, 2, str(tmp_path / "never_saved"), FileNotFoundError,
                    r"no checkpoint directory at .*never_saved", timeout=60)


def test_keep_last_and_overwrite(tmp_path):
    for step in (1, 2, 3):
        run_distributed(_save_keep_last, 2, str(tmp_path / f"step_{step}"), step, timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3"]
    # Saving over an existing checkpoint replaces it whole.
    newer = run_distributed(_save, 2, str(tmp_path / "step_3"), 4, timeout=120)[0]
    _assert_same_weights(run_distributed(_load, 2, str(tmp_path / "step_3"), timeout=120)[0], newer, "overwrite")
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3"]


def _save_keep_last(rank, world_size, path, steps, keep_last=2):
    from flatshard.checkpoint import get_state_dict, save

    _, model, opt = _build()
    _train(model, opt, range(steps), rank, world_size)
    model_sd, optim_sd = get_state_dict(model, opt)
    save({"model": model_sd, "optim": optim_sd}, path, keep_last=keep_last)


def _load_with_warning(rank, world_size, path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = _load(rank, world_size, path)
    if rank == 0:
        assert any("moved aside" in str(w.message) for w in caught), [str(w.message) for w in caught]
    return weights


def test_load_finds_checkpoint_moved_aside(tmp_path):
    """Where the filesystem cannot exchange directories, a save renames the old one aside first; a
    crash between its two renames leaves only that, and load uses it."""
    path = str(tmp_path / "ckpt")
    good = run_distributed(_save, 2, path, 2, timeout=120)[0]
    os.rename(path, str(tmp_path / ".ckpt.flatshard-old-0123456789ab"))
    _assert_same_weights(run_distributed(_load_with_warning, 2, path, timeout=120)[0], good, "moved aside")


def _save_expecting(rank, world_size, path, keep_last, error, pattern):
    with pytest.raises(error, match=pattern):
        _save_keep_last(rank, world_size, path, 1, keep_last)


def test_save_refuses_bad_paths(tmp_path):
    (tmp_path / "run1").mkdir()
    run_distributed(_save_expecting, 2, str(tmp_path / "run2"), 1, ValueError,
                    r"keep_last keeps the newest of a series of checkpoints named with a step number after '_', "
                    r"'-' or '.' \(e.g. ckpt/step_1000\), but the path's name is 'run2'", timeout=60)
    os.symlink(str(tmp_path / "run1"), str(tmp_path / "latest"))
    run_distributed(_save_expecting, 2, str(tmp_path / "latest"), None, ValueError,
                    r"latest exists and is not a directory \(a symlink or a file\)", timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["latest", "run1"]  # nothing written, nothing deleted


def _save_on_unshared_disk(rank, world_size, path, elsewhere):
    """Rank 1 writes its files where rank 0 cannot see them (as a node-local disk would)."""
    from torch.distributed.checkpoint import filesystem

    if rank == 1:
        original = filesystem.FileSystemWriter.__init__

        def local_disk(self, path, *args, **kwargs):
            original(self, elsewhere, *args, **kwargs)

        filesystem.FileSystemWriter.__init__ = local_disk
    with pytest.raises(OSError, match=r"lacks \['__1_0.distcp'\], which its .metadata refers to; the previous "
                                      r"checkpoint at .*ckpt, if any, is intact"):
        _save(rank, world_size, path, 3)


def test_save_refuses_a_directory_not_every_rank_shares(tmp_path):
    path = str(tmp_path / "ckpt")
    good = run_distributed(_save, 2, path, 2, timeout=120)[0]
    run_distributed(_save_on_unshared_disk, 2, path, str(tmp_path / "node_local"), timeout=120)
    _assert_same_weights(run_distributed(_load, 2, path, timeout=120)[0], good, "after the refused save")
