"""Runs a script's ranks as torchrun starts them, RUNS times, each rank a process forked from this one after
it imported torch and flatshard (no torch op run, no thread started: as tests/_dist.py's fork server).

    python fork_ranks.py RUNS WORLD_SIZE SCRIPT

Each rank gets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a fresh port per run)
and runs SCRIPT as ``__main__`` at this module's top level, so it ends exactly as the script's own
interpreter would: an uncaught exception prints its traceback and the interpreter finalizes with status 1
(atexit handlers, flatshard's [Note: Exit] included, then finalization); a script that falls off its end
finalizes with status 0; ``os._exit`` and signals end it as they would. What a fresh interpreter per rank
adds is the import of torch and flatshard, seconds per rank on two cores, which this pays once.

Prints one JSON line per rank and run: {"run", "rank", "status" (the exit code; minus the signal's number
for a signal), "output" (its stdout and stderr)}. A run whose ranks have not all ended within
RUN_DEADLINE_S is killed and reported with status null.
"""

import ctypes
import json
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402,F401 (imported once, here)
import torch.distributed  # noqa: E402,F401

import flatshard  # noqa: E402,F401
import models  # noqa: E402,F401

RUN_DEADLINE_S = 120.0  # a hang's bound (a run takes seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(pids: dict[int, int], deadline: float) -> dict[int, int | None]:
    """{rank: exit code} once every pid ended; ranks still running at ``deadline`` are killed (None)."""
    codes: dict[int, int | None] = {}
    while pids and time.monotonic() < deadline:
        for pid, rank in list(pids.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
                del pids[pid]
        if pids:
            time.sleep(0.02)
    for pid, rank in pids.items():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        codes[rank] = None
    return codes


runs, world_size, script = int(sys.argv[1]), int(sys.argv[2]), os.path.abspath(sys.argv[3])
logs = tempfile.mkdtemp(prefix="flatshard-fork-ranks-")
child = None
for run in range(runs):
    port = _free_port()
    pids = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        log = os.path.join(logs, f"{run}-{rank}.log")
        pid = os.fork()
        if pid == 0:
            child = (rank, port, log)
            break
        pids[pid] = rank
    if child is not None:
        break
    codes = _wait_all(pids, time.monotonic() + RUN_DEADLINE_S)
    for rank in range(world_size):
        with open(os.path.join(logs, f"{run}-{rank}.log"), errors="replace") as f:
            output = f.read()
        print(json.dumps({"run": run, "rank": rank, "status": codes[rank], "output": output}), flush=True)
if child is None:
    shutil.rmtree(logs, ignore_errors=True)

if child is not None:  # a rank: the script runs here, at top level, and its end is this process's end
    rank, port, log = child
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: ends with this launcher
    except Exception:  # noqa: BLE001 (not Linux: the launcher's deadline still kills it)
        pass
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
