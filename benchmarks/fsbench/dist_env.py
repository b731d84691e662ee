"""Process launch and the per-rank context every benchmark runs in.

CPU: gloo, one thread per rank. GPU: NCCL, one device per rank. One job is one
``mp.spawn`` of W processes; rank 0 writes the job's result as JSON, so a
crashed job is reported with its error instead of stopping the whole run.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(minutes=3)  # a hang fails the job instead of the run


@dataclass(frozen=True)
class Ctx:
    """Where this rank runs."""

    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Waits for queued device work (a no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def agree(self, ok: bool) -> bool:
        """True only if every rank says True (collective)."""
        return self.all_reduce([1.0 if ok else 0.0], dist.ReduceOp.MIN)[0] == 1.0


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def max_world_size(device_type: str) -> int:
    """Ranks a job may use: one per GPU on CUDA; any number on CPU (processes)."""
    return torch.cuda.device_count() if device_type == "cuda" else 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Task = tuple[str, Callable[[Ctx, Any], Any], Any]  # (name, module-level function, its argument)


def _worker(rank: int, world_size: int, port: int, device_type: str, tasks: list[Task], result_path: str,
            one_gpu: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if one_gpu:  # every rank on cuda:0 over gloo (NCCL refuses two ranks on one device)
        device, backend = torch.device("cuda", 0), "gloo"
        torch.cuda.set_device(device)
    elif device_type == "cuda":
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT, **kwargs)
    ctx = Ctx(rank, world_size, device, backend)
    results: dict[str, Any] = {}
    try:
        for name, fn, arg in tasks:
            try:
                results[name] = fn(ctx, arg)
            except Exception as e:  # noqa: BLE001 - the next task may still run
                results[name] = {"error": error_text(e)}
            if rank == 0:  # after every task, so a later crash keeps what is done
                with open(result_path, "w") as f:
                    json.dump(results, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(tasks: list[Task], world_size: int, device_type: str, one_gpu: bool = False) -> dict[str, Any]:
    """Runs the tasks one after another on ``world_size`` fresh ranks: {task name: rank 0's result}.

    ``one_gpu``: every rank on the first GPU, over gloo (see ``_worker``).

    A task that raises, or that a crashed job never finished, gets ``{"error": ...}``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        error = None
        try:
            mp.spawn(_worker, args=(world_size, _free_port(), device_type, tasks, path, one_gpu),
                     nprocs=world_size, join=True)
        except Exception as e:  # noqa: BLE001 - a failed job is a result to report
            error = _short_error(e)
        done = {}
        if os.path.exists(path):
            with open(path) as f:
                done = json.load(f)
    return {name: done.get(name, {"error": f"job failed: {error}"}) for name, _, _ in tasks}


def _short_error(e: BaseException) -> str:
    text = str(e).strip() or repr(e)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-6:])


def error_text(e: BaseException) -> str:
    """One line naming the exception and where it came from, for the report."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}{where}"[:400]
