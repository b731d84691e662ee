"""flatshard.testing's pytest plugin, as a user meets it: a test file like the README's, run by plain pytest.

The file (``USER_TESTS``, the README's example plus a test that fails on purpose and one that hangs on
purpose) runs in a pytest of its own (pytester's subprocess: the plugin comes from the installed
package's entry point, as for users). Its sharded runs are torch's FSDP1 class, torch's ``fully_shard``
and flatshard's ``fully_shard``, each against one process. Every rank writes its pid and its parent's
(the fork server's) where this test reads them, to check that nothing is left running afterwards.
"""

from __future__ import annotations

import os
import re
import textwrap
import time

import pytest

USER_TESTS = textwrap.dedent('''
    import os
    import time

    import pytest
    import torch
    from torch import nn

    from flatshard.testing import compare_with_single_process


    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


    def shard(model, impl):
        if impl == "torch_fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel
            return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        if impl == "torch_fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from flatshard import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)


    def loss_fn(model, batch):
        inputs, targets = batch
        return nn.functional.mse_loss(model(inputs), targets)


    def note_pids(rank):
        where = os.environ["PLUGIN_TEST_PIDS"]
        with open(os.path.join(where, f"{os.getpid()}"), "w") as f:
            f.write(f"{os.getppid()}")


    @pytest.mark.parametrize("impl", ["torch_fsdp1", "torch_fsdp2", "flatshard_fully_shard"])
    @pytest.mark.world_size(2)
    def test_two_steps_match_one_process(rank, world_size, impl):
        note_pids(rank)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]
        compare_with_single_process(rank, world_size, make_model, lambda m: shard(m, impl), batches, loss_fn)


    @pytest.mark.world_size(2)
    def test_fails_on_purpose(rank, world_size):
        note_pids(rank)
        expected = 0
        assert rank == expected


    @pytest.mark.world_size(2, timeout=4)
    def test_hangs_on_purpose(rank, world_size):
        note_pids(rank)
        if rank == 1:
            time.sleep(600)
''')


MISUSE = textwrap.dedent('''
    import pytest


    @pytest.mark.world_size(2)
    def test_without_rank_arguments(tmp_path):
        pass
''')


def _alive(pid: int) -> bool:
    """Running (a zombie, which only waits for its parent to read its status, is not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_a_users_test_file_under_plain_pytest(pytester, tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("PLUGIN_TEST_PIDS", str(pids))
    pytester.makepyfile(test_user=USER_TESTS, test_misuse=MISUSE)
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                                           timeout=300)
    took = time.monotonic() - started
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    # The three sharded runs (torch's FSDP1 and FSDP2, flatshard's fully_shard) pass; the two on purpose fail.
    assert outcomes.get("passed") == 3 and outcomes.get("failed") == 2, out[-6000:]
    assert "FAILED test_user.py::test_two_steps" not in out, out[-6000:]
    # The failing rank's assertion, rewritten in the rank: both values.
    assert "FAILED test_user.py::test_fails_on_purpose[W2]" in out and "assert 1 == 0" in out, out[-6000:]
    # The hanging rank: the deadline, and its stack (the sleep on its line).
    assert "FAILED test_user.py::test_hangs_on_purpose[W2]" in out, out[-6000:]
    assert "rank 1 (still running" in out or "rank(s) [1] had not finished" in out, out[-6000:]
    assert re.search(r"File \".*test_user.py\", line \d+ in test_hangs_on_purpose", out), out[-6000:]
    # A marker without the rank arguments: its file's collection fails, naming the fix; the others ran.
    assert "ERROR test_misuse.py" in out and "takes the arguments rank and world_size" in out, out[-6000:]
    # Nothing left running: the ranks, and the fork server they came from.
    ranks = {int(p.name): int(p.read_text()) for p in pids.iterdir()}
    assert len(ranks) == 2 * 5, sorted(ranks)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in [*ranks, *ranks.values()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in [*ranks, *set(ranks.values())] if _alive(pid)]
    assert not left, f"still running after the session: {left}"
    assert took < 240, f"the user's session took {took:.0f} s"  # (a bound on a hang, not a timing claim)


def test_nccl_without_enough_gpus_is_skipped_with_the_reason():
    import torch

    from flatshard.testing import run_distributed

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    with pytest.raises(pytest.skip.Exception, match=r"needs 64 GPUs for NCCL \(one per rank\); this machine has \d+"):
        run_distributed(os.getpid, 64, backend="nccl")


def test_the_plugin_imports_nothing_of_flatshard_until_a_marked_test_runs():
    """pytest loads the plugin in every session where flatshard is installed: loading it must not import flatshard
    (its extension) nor torch."""
    import subprocess
    import sys

    probe = ("import sys, _flatshard_pytest_plugin; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flatshard', 'torch')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
