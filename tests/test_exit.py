"""A process whose backward raised exits with its traceback and status 1, never by a signal
(see [Note: Exit] in python/flatshard/_exit.py).

Real interpreters, not the fork-server ranks of _dist.py (whose exit is os._exit): each run
starts two ranks of tests/scripts/backward_raises_then_exit.py, as torchrun would, whose
backward raises on both ranks with collectives in flight and lets the exception end the
script. Before the fix about half of such runs had a rank die by SIGABRT at exit (4 of 8
here), when gloo released a Python object during interpreter shutdown: twelve runs all pass by
chance with that fault in one try of 4000 (0.5 ** 12).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

RUNS = 12
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "backward_raises_then_exit.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exit_after_a_raised_backward_is_status_1_never_a_signal():
    outcomes = []
    for run in range(RUNS):
        port = _free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, SCRIPT],
                env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for rank in range(2)
        ]
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise AssertionError(f"run {run}: rank {rank} did not exit within 120 s")
            outcomes.append((run, rank, proc.returncode, out))
    bad = [(run, rank, code, out[-600:]) for run, rank, code, out in outcomes
           if code != 1 or "Stop: the backward raised (on every rank)" not in out]
    assert not bad, f"{len(bad)} of {len(outcomes)} rank exits were not status 1 with the traceback:\n" + "\n".join(
        f"run {run} rank {rank}: exit {code}\n{out}" for run, rank, code, out in bad[:3])
