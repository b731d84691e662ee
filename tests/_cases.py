"""Many cases in one process start: the runner behind the per-case distributed tests.

[Note: One process start per world size]
Starting W ranks costs a fork, an import and a rendezvous each time; a test per case
would pay it dozens of times. So ``CaseRun`` runs every case of one key (a world size,
usually) in ONE ``run_distributed`` call and caches what each rank returned; each case
is still its own pytest test, reading its entry. A case that raises is recorded (its
traceback goes to its test) and the next one runs. After each case the ranks compare
their outcomes on a control group of their own; if they disagree (one rank raised while
another may still sit in a collective, until the short collective timeout) the run
stops with an error naming that case, because the default group may then be out of step
across ranks. A run that fails as a whole is cached as its exception and re-raised by
every test that reads it.

What every case of a run needs and only a run can make once (process groups, a device
mesh) comes from an optional ``setup``, called on each rank after the control group and
before the first case; its result is passed to every case.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Hashable

from flatshard.testing import check_same_outcome, run_distributed

__all__ = ["CaseRun", "WORLD_SIZES", "run_cases", "scratch_dir"]

#: World sizes every distributed test of this suite runs at (pytest param list).
WORLD_SIZES = [1, 2, 4]


def scratch_dir(prefix: str) -> str:
    """A directory name for the files a test module's ranks write (checkpoints), unique to this process and
    removed when it exits. Named, not made: a module imported in every process (each pytest worker, each rank
    that unpickles a case function) makes nothing; what writes there (``dcp.save``) makes it, under the name
    the pytest process passed to its ranks."""
    owner = os.getpid()
    path = os.path.join(tempfile.gettempdir(), f"{prefix}{owner}")

    def remove() -> None:
        if os.getpid() == owner:  # not in a process forked from this one, which inherits the handler
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def run_cases(rank: int, world_size: int, case_fn: Callable, names: list[str], cases: list, args: tuple,
              control_timeout_s: float, setup: Callable | None = None) -> dict[str, dict[str, Any]]:
    """Rank side: ``case_fn(rank, world_size, case, *args)`` for each case.

    With ``setup``, ``prepared = setup(rank, world_size, cases, *args)`` runs once first
    and each case is called as ``case_fn(rank, world_size, case, *args, prepared)``; if
    setup raises, the run fails as a whole.

    Returns {case name: {"error": traceback or None, "result": what case_fn returned}}.
    """
    import torch.distributed as dist

    # Every rank creates it, first thing, in the same order (then setup's groups, if any).
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))
    if setup is not None:
        args = (*args, setup(rank, world_size, cases, *args))
    out: dict[str, dict[str, Any]] = {}
    for name, case in zip(names, cases):
        print(f"== case {name}", flush=True)
        error, result = None, None
        try:
            result = case_fn(rank, world_size, case, *args)
        except Exception:  # noqa: BLE001 - reported by this case's test
            error = traceback.format_exc()
            print(error, flush=True)
        gc.collect()
        out[name] = {"error": error, "result": result}
        check_same_outcome(f"case {name!r}", error, control)
    return out


class CaseRun:
    """The cached per-rank results of ``case_fn`` over the cases of each key.

    ``cases_of(key)`` gives ``(world_size, [(name, case), ...])``; ``results(key, name)``
    runs that key's cases once (see [Note: One process start per world size]) and returns
    the per-rank results of case ``name``, failing the test with every rank's traceback if
    the case raised anywhere. ``setup``: see ``run_cases``. ``case_fn`` and ``setup`` must
    be module-level functions (they are pickled to the ranks).
    """

    def __init__(self, case_fn: Callable, cases_of: Callable[[Hashable], tuple[int, list[tuple[str, Any]]]],
                 *args: Any, setup: Callable | None = None, timeout: float = 300.0,
                 pg_timeout: float = 30.0) -> None:
        self._case_fn = case_fn
        self._cases_of = cases_of
        self._args = args
        self._setup = setup
        self._timeout = timeout
        self._pg_timeout = pg_timeout
        self._cache: dict[Hashable, Any] = {}

    def _run(self, key: Hashable) -> list[dict[str, dict[str, Any]]]:
        if key not in self._cache:
            world_size, cases = self._cases_of(key)
            try:
                self._cache[key] = run_distributed(
                    run_cases, world_size, self._case_fn, [n for n, _ in cases], [c for _, c in cases], self._args,
                    3 * self._pg_timeout, self._setup, timeout=self._timeout, pg_timeout=self._pg_timeout)
            except Exception as e:  # noqa: BLE001 - re-raised by each test that reads it
                self._cache[key] = e
        res = self._cache[key]
        if isinstance(res, Exception):
            raise res
        return res

    def results(self, key: Hashable, name: str) -> list[Any]:
        """Per rank, what case ``name`` of ``key`` returned; raises with the tracebacks if it raised."""
        per_rank = [by_name[name] for by_name in self._run(key)]
        errors = [f"rank {rank}: {r['error'].rstrip()}" for rank, r in enumerate(per_rank) if r["error"]]
        assert not errors, f"case {name} of {key}:\n" + "\n".join(errors)
        return [r["result"] for r in per_rank]
