"""Tests of the multi-process harness itself (tests/_dist.py).

A harness that hangs or hides a failing rank makes every distributed test useless, so
each failure mode is provoked here on purpose: a rank that raises, one that hangs,
one that exits, one that crashes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from _dist import (
    WORLD_SIZES,
    DistributedTestFailure,
    DistributedTestTimeout,
    run_distributed,
)

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


def test_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_raise_on_rank1, 2, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 30, f"took {elapsed:.1f} s to report a raising rank"
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
    timeout = 5.0
    start = time.monotonic()
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_hang_on_rank1, 2, str(tmp_path), timeout=timeout)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < timeout + 10, f"took {elapsed:.1f} s with a {timeout} s timeout"
    assert "rank(s) [0, 1] had not finished" in message
    # The stacks dumped at the timeout show where each rank was stuck.
    assert "_hang_on_rank1" in message
    assert "barrier" in message
    _assert_all_dead(str(tmp_path), 2)


def test_exiting_rank_is_reported(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_exit3_on_rank1, 2, str(tmp_path), timeout=60)
    assert time.monotonic() - start < 30
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


# Generous bound: with a fork server a call costs ~0.05-0.15 s here; starting ranks
# with "spawn" (a fresh interpreter importing torch) costs ~2-3 s per rank.
MAX_OVERHEAD_S = 2.0


def test_per_call_overhead_is_small():
    run_distributed(_noop, 1)  # start the fork server outside the measurement
    overhead = {}
    for world_size in WORLD_SIZES:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            assert run_distributed(_noop, world_size) == list(range(world_size))
            times.append(time.perf_counter() - start)
        overhead[world_size] = statistics.median(times)
    print("run_distributed overhead (median of 3, s):", {w: round(t, 3) for w, t in overhead.items()})
    slow = {w: t for w, t in overhead.items() if t > MAX_OVERHEAD_S}
    assert not slow, f"per-call overhead above {MAX_OVERHEAD_S} s: {slow}"
