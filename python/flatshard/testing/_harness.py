"""flatshard.testing's harness: run a function on W ranks, each a process with a process group.

``run_distributed(fn, world_size, *args, backend=None, timeout=..., **kwargs)`` starts
``world_size`` processes, initializes a process group in each (NCCL with a GPU per rank where
there are enough GPUs, else gloo; see [Note: Backends and devices]), calls
``fn(rank, world_size, *args, **kwargs)`` and returns the per-rank return values. It knows
nothing of flatshard: the ranks run whatever FSDP the function uses, torch's or flatshard's.

[Note: Backends and devices]
``backend=None`` picks NCCL when torch sees CUDA and at least ``world_size`` GPUs, each rank
then on GPU ``rank`` (``torch.cuda.set_device``), and gloo on the CPU otherwise; a test asks for
one with ``backend="gloo"`` or ``"nccl"``, and one that asks for NCCL on a machine with fewer
GPUs than ranks is skipped, with the reason. The group's collective timeout is below the run's
deadline (two thirds of it, at most 60 s, unless given), so that a rank stuck in a collective
raises the backend's error, with its traceback, before the deadline kills it.

[Note: Never hang]
A test that hangs is worse than one that fails. The parent waits on every rank's
result pipe and process sentinel at once, with the run's deadline:
- a rank that raises sends its formatted traceback, then exits;
- a rank that dies (non-zero exit, signal, ``os._exit``) is seen through its sentinel;
- on the first failure the ranks still running are asked for their Python stacks
  (faulthandler on SIGUSR1: where a peer hangs is usually why), then killed (SIGKILL),
  and ``DistributedTestFailure`` is raised with the failing rank's traceback and log
  and the others' stacks;
- past the deadline, every unfinished rank is asked to dump its Python stacks
  (faulthandler on SIGUSR1), then all are killed and ``DistributedTestTimeout`` names
  the unfinished ranks and shows their stacks.
Every child is killed and reaped before ``run_distributed`` returns or raises.
If the test process itself is killed, the fork server exits and takes the ranks with
it (see _die_with_fork_server), so nothing is left behind.

[Note: Fast start]
Importing torch costs seconds; a fresh interpreter per rank per test would pay it
W times per test. Children are forked from a ``forkserver`` process that imported
torch, torch.distributed, torch.distributed.fsdp, torch._dynamo, pytest (and flatshard with both
front-ends and the runtime, when importable; and what ``preload`` or the ``rank_preload`` ini option adds) but never ran a torch op, so no thread pool or OpenMP state is inherited
(the reason not to ``fork`` the pytest process itself, which does run ops). The fork
server starts once per test session (~2 s); a call then costs a fork per rank, the
import of the test module, and the gloo rendezvous: ~0.03 / 0.06 / 0.1 s at world
size 1 / 2 / 4 on two idle cores (test_harness.py checks the mechanism, not the time).

[Note: Assertions in ranks]
pytest rewrites ``assert`` statements of test modules when it imports them, so a bare
``assert a == b`` reports both values. A rank imports the test module anew (to unpickle
the function) and would get plain asserts, reporting only "AssertionError". So when the
function's module was rewritten by pytest in the parent, the parent compiles it once
through pytest's rewriter and each rank imports it from that code before unpickling
anything (``fn``, ``args`` and ``kwargs`` travel as one pickled bytes object for that
reason); if that fails, the ordinary import follows.

[Note: Child output]
The fork server is started once and keeps the stdout/stderr of the moment it started,
which under pytest's capture belong to whichever test ran first. So each rank
redirects its fds 1 and 2 to its own log file; the parent echoes the logs to its own
stdout after the run (pytest shows them with a failing test) and puts the failing
rank's log into the error message.
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import functools
import gc
import importlib
import importlib.util
import marshal
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = [
    "DistributedTestFailure",
    "DistributedTestTimeout",
    "abandon_group",
    "check_same_outcome",
    "preload",
    "run_distributed",
    "set_default_backend",
]

_GROUP_ABANDONED = False


def abandon_group() -> None:
    """Called by a rank function whose process group holds collectives that will never pair (a test of
    exactly that): the harness then neither runs its closing barrier nor destroys the group (both would
    wait on them); the rank's process ends with its result as always."""
    global _GROUP_ABANDONED
    _GROUP_ABANDONED = True


def check_same_outcome(what: str, error: str | None, group) -> None:
    """Inside a rank running several cases: raises unless every rank ended ``what`` alike.

    ``error`` is this rank's traceback text, or None. The same outcome everywhere (ok, or
    the same exception) means the ranks left the case at the same point; otherwise the
    default group may be out of step and the remaining cases must not run.
    """
    import torch.distributed as dist

    outcome = "ok" if error is None else error.strip().splitlines()[-1]
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    if len(set(outcomes)) > 1:
        raise RuntimeError(
            f"{what} ended differently across ranks (by rank: {outcomes}); the remaining cases "
            f"were not run. This rank's error:\n{error or 'none'}"
        )


#: Modules imported by the fork server before it forks any rank (see [Note: Fast start]).
#: torch._dynamo is imported lazily by the first optimizer a process builds (~0.5 s);
#: pytest by every test module a rank unpickles its function from. None starts a thread.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo", "pytest"]

#: How long a killed child may take to be reaped before we give up waiting.
_REAP_TIMEOUT_S = 10.0
#: How long an unfinished rank gets to write its stacks before it is killed.
_STACK_DUMP_WAIT_S = 1.0
#: Most characters of a rank's log put into an error message.
_LOG_TAIL_CHARS = 8000


def preload(*modules: str) -> None:
    """Modules the fork server imports before it forks the first rank (a test suite's helpers that import heavy
    libraries, say), beside torch's. Call it before the first run (a conftest, or the ``rank_preload`` ini option);
    later calls raise, since the server has started."""
    with _ctx_lock:
        if _ctx is not None:
            raise RuntimeError(f"flatshard.testing.preload{modules}: the fork server has started already (a "
                               f"distributed test ran); preload from a conftest.py or the rank_preload ini option")
        _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


_configured_backend: str | None = None  # the session's default (the plugin's --rank-backend / rank_backend), or auto


def set_default_backend(backend: str | None) -> None:
    """The backend ``run_distributed`` and the marker use when a test names none: "gloo", "nccl", or None (auto: see
    [Note: Backends and devices]). The plugin sets it from ``--rank-backend`` or the ``rank_backend`` ini option."""
    global _configured_backend
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"flatshard.testing: backend: expected 'auto', 'gloo' or 'nccl' but got {backend!r}")
    _configured_backend = backend


def _plugin_settings() -> dict:
    """The pytest plugin's session settings (``--rank-backend``, ``rank_preload``), if it is loaded."""
    plugin = sys.modules.get("_flatshard_pytest_plugin")
    return getattr(plugin, "SETTINGS", {})


def _default_backend(world_size: int) -> str:
    """See [Note: Backends and devices]."""
    import torch

    if _configured_backend is not None:
        return _configured_backend
    session = _plugin_settings().get("backend")
    if session is not None:
        return session
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


class DistributedTestFailure(AssertionError):
    """A rank raised, died, or the run timed out. The message holds the details."""


class DistributedTestTimeout(DistributedTestFailure):
    """The run exceeded its timeout; the message names the ranks that had not finished."""


_ctx_lock = threading.Lock()
_ctx = None


def _get_context():
    """The forkserver context, with the preload list set before the server starts."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            preload = list(_PRELOAD) + [m for m in _plugin_settings().get("preload", []) if m not in _PRELOAD]
            # Preload flatshard and its runtime (``import flatshard`` alone loads neither: [Note: A lazy import]),
            # only if they import cleanly here: the fork server swallows ImportError but any other exception at
            # preload would kill it.
            for name in ("flatshard", "flatshard.fully_sharded_data_parallel", "flatshard._fully_shard"):
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - not installed or broken: children import it
                    break
                preload.append(name)
            ctx.set_forkserver_preload(preload)
            _ctx = ctx
        return _ctx


def _die_with_fork_server() -> None:
    """Make this rank die when the test process dies, even if the rank hangs.

    The fork server exits when its "alive" pipe reaches EOF, i.e. when every holder
    of the write end is gone; but each forked child inherits a copy, so a hung rank
    would keep the server, and itself, alive forever. Close that copy, then (Linux)
    ask for SIGKILL when the parent, the fork server, exits.
    """
    try:
        from multiprocessing import forkserver

        alive_fd = forkserver._forkserver._forkserver_alive_fd
        if alive_fd is not None:
            os.close(alive_fd)
            forkserver._forkserver._forkserver_alive_fd = None
    except Exception:  # noqa: BLE001 - private API; best effort
        pass
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort; the parent still kills us
        return
    if os.getppid() != parent:  # the server died before prctl took effect
        os._exit(1)


def _send(conn, kind: str, payload: Any) -> None:
    # Pickle explicitly with the standard pickler: Connection.send would use
    # ForkingPickler, for which torch registers shared-memory reductions of tensors
    # whose storage must outlive this (exiting) process.
    conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _child_main(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    pg_timeout_s: float,
    conn,
    log_path: str,
    rewrite: tuple[str, str, bytes] | None,
    call: bytes,
) -> None:
    """Entry point of one rank. Never returns: it exits with os._exit.

    ``call`` is the pickled ``(fn, args, kwargs)``; ``rewrite`` the ``(name, path, code)``
    of a module to import with pytest's assert rewriting first, see
    [Note: Assertions in ranks].
    """
    _die_with_fork_server()
    # What the fork server imported (torch, dynamo, flatshard: hundreds of thousands of objects) is never garbage
    # of a test's: leave it out of every collection in the rank (a full one drops from ~0.15 s to what the test
    # made; tests/_cases.py collects after each case).
    gc.freeze()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # fatal signals
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # hang dumps

    exit_code = 0
    fn = None
    try:
        import torch
        import torch.distributed as dist

        if rewrite is not None:
            _import_with_assert_rewriting(*rewrite)
        fn, args, kwargs = pickle.loads(call)
        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank (see [Note: Backends and devices])
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        if backend == "gloo":
            # gloo's init has no barrier either: a rank whose test fails at once would be reported (and its peers
            # killed) while a peer still connects, whose report is then gloo's "Connection closed by peer" instead
            # of its test's. Every rank joins before any runs its test (NCCL connects lazily, at the first collective).
            dist.barrier()
        result = fn(rank, world_size, *args, **kwargs)
        if dist.is_initialized() and not _GROUP_ABANDONED:
            # Without it a fast rank could exit while a peer is still connecting to it
            # (init has no barrier), failing the peer with "Connection closed by peer".
            try:
                dist.barrier()
            except Exception as e:  # noqa: BLE001 - said plainly: the peer's stacks follow in the report
                raise RuntimeError(f"rank {rank} finished, but a peer did not reach the end within the group's timeout "
                                   f"({pg_timeout_s:g} s): see the stacks of the ranks still running below") from e
            dist.destroy_process_group()
        try:
            _send(conn, "ok", result)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"rank {rank}: the return value of {getattr(fn, '__qualname__', fn)} "
                f"must be picklable but pickling it failed: {e}"
            ) from e
    except BaseException:  # noqa: BLE001 - everything, SystemExit included, is reported
        exit_code = 1
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        try:
            _send(conn, "error", (time.time(), tb))
        except Exception:  # noqa: BLE001 - parent is gone or pipe broken; exit anyway
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # Skip atexit handlers and finalizers: they could block on gloo threads.
            os._exit(exit_code)


def _rewritten_module_of(fn) -> tuple[str, str, bytes] | None:
    """``(name, file, marshaled code)`` of ``fn``'s module with its asserts rewritten
    by pytest, if pytest rewrote it in this process; else ``None``."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if module is None or not path or "@py_builtins" not in vars(module):
        return None
    try:
        code = _rewritten_code(path, os.stat(path).st_mtime_ns)
    except Exception:  # noqa: BLE001 - ranks import it plainly
        return None
    return module.__name__, path, code


@functools.lru_cache(maxsize=None)
def _rewritten_code(path: str, mtime_ns: int) -> bytes:
    """The module at ``path`` compiled with pytest's assert rewriting, marshaled.

    Done once in the parent (~25 ms for a test module) instead of once per rank.
    """
    from _pytest.assertion.rewrite import rewrite_asserts

    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    return marshal.dumps(compile(tree, path, "exec", dont_inherit=True))


def _import_with_assert_rewriting(name: str, path: str, code: bytes) -> None:
    """Import module ``name`` from ``path`` by running ``code`` (see _rewritten_code).

    Does nothing if ``name`` is already imported; on any failure leaves it unimported
    so the ordinary import happens when the function is unpickled.
    """
    if name in sys.modules:
        return
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(marshal.loads(code), module.__dict__)
    except Exception:  # noqa: BLE001 - fall back to the plain import
        sys.modules.pop(name, None)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"


def _read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(text: str, limit: int = _LOG_TAIL_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 90.0,
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Each rank is a separate process with ``torch.set_num_threads(1)`` and a default
    process group of ``backend`` (None: NCCL with a GPU per rank where there are enough
    GPUs, else gloo; see [Note: Backends and devices]; FileStore rendezvous, collective
    timeout ``pg_timeout`` seconds, by default two thirds of ``timeout`` and at most 60);
    after ``fn`` returns, a barrier, then the group is destroyed (unless ``fn`` destroyed
    it).

    The defaults fail a hung run well within two minutes: a rank stuck in a
    collective raises the backend's timeout after ``pg_timeout`` seconds (with its
    traceback); one stuck anywhere else is killed at ``timeout``.

    ``fn`` must be a module-level function (it is pickled by reference); ``args``,
    ``kwargs`` and the return value must be picklable. Blocks until every rank
    finished, one failed, or ``timeout`` seconds passed.

    Returns the per-rank return values, indexed by rank.
    Raises ``DistributedTestFailure`` with the failing rank's traceback if a rank
    raised or died, ``DistributedTestTimeout`` naming the unfinished ranks (and their
    stacks) if the run exceeded ``timeout``. See [Note: Never hang].
    """
    __tracebackhide__ = True
    return _run(fn, world_size, args, kwargs, backend=backend, timeout=timeout, pg_timeout=pg_timeout)


def _run(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, *, backend: str | None, timeout: float,
         pg_timeout: float | None, rewrite_from: Callable[..., Any] | None = None) -> list[Any]:
    """``run_distributed``; ``rewrite_from``: the function whose module the ranks import with pytest's assertion
    rewriting, and whose name the errors give (default ``fn``; the plugin's marker calls a test function through a
    wrapper)."""
    __tracebackhide__ = True  # (pytest shows the test's failure, not this function's lines)
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1 but got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout: expected > 0 seconds but got {timeout}")
    if backend is None:
        backend = _default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected None (automatic), 'gloo' or 'nccl' but got {backend!r}")
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            import pytest

            pytest.skip(f"needs {world_size} GPUs for NCCL (one per rank); this machine has {gpus}")
    if pg_timeout is None:
        pg_timeout = min(60.0, timeout * 2 / 3)
    ctx = _get_context()
    fn_name = getattr(rewrite_from or fn, "__qualname__", repr(fn))
    # Standard pickle (by value for tensors; see _send), once for all ranks.
    try:
        call = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"run_distributed: expected a module-level function and picklable arguments, "
            f"but pickling {fn_name} and its arguments failed: {e}"
        ) from e
    rewrite = _rewritten_module_of(rewrite_from or fn)
    tmpdir = tempfile.mkdtemp(prefix="flatshard-dist-")
    init_method = f"file://{os.path.join(tmpdir, 'store')}"
    log_paths = [os.path.join(tmpdir, f"rank{r}.log") for r in range(world_size)]
    procs: list = []
    conns: list = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                name=f"{fn_name}-rank{rank}",
                args=(rank, world_size, init_method, backend, pg_timeout, writer, log_paths[rank], rewrite, call),
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only write end: EOF means it is gone
            procs.append(proc)
            conns.append(reader)
        deadline = time.monotonic() + timeout
        results, failures = _collect(procs, conns, deadline)

        pending = [r for r in range(world_size) if r not in results and r not in failures]
        if failures:
            running = _dump_stacks(procs, pending)  # where the others were (a peer that hangs, most often)
            _kill_all(procs)
            _echo_logs(log_paths)
            raise DistributedTestFailure(_failure_message(fn_name, world_size, failures, log_paths, running))
        if pending:
            _dump_stacks(procs, pending)
            _kill_all(procs)
            _echo_logs(log_paths)
            raise DistributedTestTimeout(_timeout_message(fn_name, world_size, timeout, pending, log_paths))
        _reap(procs)
        _echo_logs(log_paths)
        return [results[r] for r in range(world_size)]
    finally:
        _kill_all(procs)
        for c in conns:
            c.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(procs, conns, deadline):
    """Wait for every rank's result until the first failure or the deadline.

    Returns ``(results, failures)``: rank -> value, and rank -> (wall time, description)
    of a rank that raised or died. Ranks in neither had not finished at the deadline.
    """
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    pending = set(range(len(procs)))
    while pending and not failures:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        multiprocessing.connection.wait(waitables, timeout=remaining)
        for r in sorted(pending):
            outcome = _poll_rank(procs[r], conns[r])
            if outcome is None:
                continue
            kind, payload = outcome
            pending.discard(r)
            if kind == "ok":
                results[r] = payload
            else:
                failures[r] = payload
    return results, failures


def _poll_rank(proc, conn):
    """``None`` if the rank is still running, else ``("ok", value)`` or
    ``("error", (wall time of the failure, description))``.

    The pipe is read before the sentinel: a rank reports, then exits, so a readable
    pipe of an exited rank still holds its report.
    """
    if conn.poll():
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            pass  # died without reporting: fall through to the exit status
        except Exception as e:  # noqa: BLE001 - e.g. the value cannot be unpickled here
            return "error", (time.time(), f"the parent could not read this rank's report: {e!r}")
        else:
            return kind, payload
    elif proc.is_alive():
        return None
    proc.join(_REAP_TIMEOUT_S)
    return "error", (time.time(), f"process died without reporting a result ({_describe_exit(proc.exitcode)})")


def _kill_all(procs) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                p.kill()
            except (ProcessLookupError, OSError):
                pass
    _reap(procs)


def _reap(procs) -> None:
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:  # exited cleanly but slow to leave: force it
            p.kill()
            p.join(max(0.0, deadline - time.monotonic()))


def _echo_logs(log_paths) -> None:
    for rank, path in enumerate(log_paths):
        text = _read_log(path)
        if text:
            sys.stdout.write(f"----- rank {rank} output -----\n{text}")
            if not text.endswith("\n"):
                sys.stdout.write("\n")
    sys.stdout.flush()


def _dump_stacks(procs, ranks) -> list[int]:
    """Asks ``ranks`` for their Python stacks (faulthandler on SIGUSR1, into their logs; see [Note: Never hang]) and
    gives them a moment to write them; the ranks that were still running."""
    running = []
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid is not None:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
                running.append(r)
            except ProcessLookupError:
                pass
    if running:
        time.sleep(_STACK_DUMP_WAIT_S)
    return running


def _failure_message(fn_name, world_size, failures, log_paths, running=()) -> str:
    # Earliest failure first: the others are usually its echo (a peer's connection
    # closing under a collective).
    ranks = sorted(failures, key=lambda r: (failures[r][0], r))
    parts = [
        f"{fn_name} failed at world size {world_size} on rank(s) {sorted(ranks)} "
        f"(rank {ranks[0]} first); the other ranks were killed."
    ]
    for r in ranks:
        text = failures[r][1].rstrip()
        parts.append(f"\n===== rank {r} =====\n{text}")
        log = _read_log(log_paths[r]).strip()
        if log and text not in log:
            parts.append(f"\n----- rank {r} output -----\n{_tail(log)}")
    for r in running:
        parts.append(f"\n===== rank {r} (still running; its output, with its Python stacks at the failure) =====\n"
                     f"{_tail(_read_log(log_paths[r]).strip()) or '(no output)'}")
    return "\n".join(parts)


def _timeout_message(fn_name, world_size, timeout, pending, log_paths) -> str:
    done = sorted(set(range(world_size)) - set(pending))
    parts = [
        f"{fn_name} timed out after {timeout:g} s at world size {world_size}: "
        f"rank(s) {sorted(pending)} had not finished (finished: {done}); all were killed. "
        "Their output, with Python stacks dumped at the timeout, follows."
    ]
    for r in sorted(pending):
        parts.append(f"\n===== rank {r} =====\n{_tail(_read_log(log_paths[r]).strip()) or '(no output)'}")
    return "\n".join(parts)
