"""Tests of the multi-process harness itself (flatshard.testing's run_distributed; the plugin's marker: test_testing_plugin.py).

A harness that hangs or hides a failing rank makes every distributed test useless, so
each failure mode is provoked here on purpose: a rank that raises, one that hangs,
one that exits, one that crashes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from _cases import WORLD_SIZES
from flatshard.testing import DistributedTestFailure, DistributedTestTimeout, run_distributed

# Rank functions: module level so the ranks can unpickle them by reference.


def _report_environment(rank, world_size, payload):
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "sum": t.item(),
        "payload": payload,
        "tensor": torch.arange(3) * rank,
    }


def _noop(rank, world_size):
    return rank


def _print_and_return(rank, world_size):
    print(f"hello from rank {rank}", flush=True)
    return rank


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits in a collective that rank 1 never joins


def _assert_on_rank1(rank, world_size):
    observed = rank * 10
    if rank == 1:
        assert observed == 11, f"rank 1 observed {observed}, expected 11"
    dist.barrier()


def _bare_assert_on_rank1(rank, world_size):
    observed = rank * 10
    if rank == 1:
        assert observed == 11
    dist.barrier()


def _write_pid(pid_dir, rank):
    # Written then renamed, so a rank killed mid-write leaves no partial file.
    path = os.path.join(pid_dir, f"{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def _hang_on_rank1(rank, world_size, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 1:
        while True:
            time.sleep(3600)
    dist.barrier()


def _exit3_on_rank1(rank, world_size, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _segfault_on_rank1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _return_unpicklable(rank, world_size):
    return lambda: rank


def _assert_all_dead(pid_dir, world_size):
    # A rank may be killed (because a peer failed) before it wrote its pid:
    # check every pid that was written, and that at least one was.
    pids = []
    for rank in range(world_size):
        path = os.path.join(pid_dir, f"{rank}.pid")
        if os.path.exists(path):
            with open(path) as f:
                pids.append(int(f.read()))
    assert pids, "no rank wrote its pid"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no such process: killed and reaped
    assert multiprocessing.active_children() == []


# Tests.


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_returns_per_rank_values_in_rank_order(world_size):
    results = run_distributed(_report_environment, world_size, "payload")
    expected_sum = world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert r["dist_rank"] == rank
        assert r["world_size"] == r["dist_world_size"] == world_size
        assert r["backend"] == "gloo"
        assert r["threads"] == 1
        assert r["sum"] == expected_sum
        assert r["payload"] == "payload"
        assert torch.equal(r["tensor"], torch.arange(3) * rank)


def test_child_output_reaches_the_test(capsys):
    assert run_distributed(_print_and_return, 2) == [0, 1]
    out = capsys.readouterr().out
    assert "hello from rank 0" in out
    assert "hello from rank 1" in out


# [Note: Ending on the first failure] The harness ends a run at its first failing rank, killing the others,
# which wait in a collective the failed rank never joins. The tests below show that by the outcome, not by a
# time: the waiting rank's group timeout is set far beyond the run's deadline (LONG), so only the harness can
# end it, and a harness that waited for it would end the run as a DistributedTestTimeout instead.
LONG = dict(timeout=120, pg_timeout=3600)


def test_raising_rank_fails_fast_with_its_traceback():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_raise_on_rank1, 2, **LONG)
    message = str(info.value)
    assert "rank 1 first" in message
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank1" in message  # the frame, not just the exception
    assert "ValueError: boom from rank 1" in message
    assert not isinstance(info.value, DistributedTestTimeout)


def test_assertion_in_rank_surfaces_with_its_message():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_assert_on_rank1, 2, timeout=60)
    assert "AssertionError: rank 1 observed 10, expected 11" in str(info.value)


def test_bare_assert_in_rank_reports_values():
    # pytest's assert rewriting reaches the ranks: see [Note: Assertions in ranks].
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_bare_assert_on_rank1, 2, timeout=60)
    assert "assert 10 == 11" in str(info.value)


def test_hanging_rank_times_out_and_leaves_no_process(tmp_path):
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_hang_on_rank1, 2, str(tmp_path), timeout=5.0, pg_timeout=3600)
    message = str(info.value)
    assert "timed out after 5 s" in message, message
    assert "rank(s) [0, 1] had not finished" in message
    # The stacks dumped at the timeout show where each rank was stuck.
    assert "_hang_on_rank1" in message
    assert "barrier" in message
    _assert_all_dead(str(tmp_path), 2)


def test_exiting_rank_is_reported(tmp_path):
    with pytest.raises(DistributedTestFailure) as info:  # see [Note: Ending on the first failure]
        run_distributed(_exit3_on_rank1, 2, str(tmp_path), **LONG)
    message = str(info.value)
    # Rank 0 may notice the lost peer (connection reset) before the harness sees
    # rank 1's exit: which is reported first is a race, that rank 1's exit is not.
    assert "rank 1" in message or "[0, 1]" in message
    assert "exit code 3" in message
    _assert_all_dead(str(tmp_path), 2)


def test_crashing_rank_is_reported_with_its_stack():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_segfault_on_rank1, 2, timeout=60)
    message = str(info.value)
    assert "rank 1" in message or "[0, 1]" in message  # see test_exiting_rank_is_reported
    assert "killed by SIGSEGV" in message
    assert "Segmentation fault" in message  # faulthandler's report from the rank's log
    assert "_segfault_on_rank1" in message


def test_unpicklable_result_is_an_error():
    with pytest.raises(DistributedTestFailure, match="must be picklable"):
        run_distributed(_return_unpicklable, 1, timeout=60)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_noop, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_noop, 1, timeout=0)
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda rank, world_size: rank, 1)


def _parent_with_torch(rank, world_size):
    parent = os.getppid()
    with open(f"/proc/{parent}/maps") as f:
        return parent, any("libtorch" in line for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc (Linux)")
def test_ranks_are_forked_from_one_server_that_imported_torch():
    """[Note: Fast start] by its mechanism, not by a time: every rank of every call is a child of the same fork
    server (not of the test process), and that server has torch loaded, so no rank pays torch's import."""
    parents = set()
    for world_size in WORLD_SIZES:
        for parent, has_torch in run_distributed(_parent_with_torch, world_size):
            assert has_torch, f"rank's parent {parent} has not loaded torch"
            parents.add(parent)
    assert len(parents) == 1 and os.getpid() not in parents, parents
