"""Run torch's own FSDP2 unit tests against torch's ``fully_shard`` or flatshard's (and, with ``--api fsdp1``,
torch's own FSDP1 unit tests against torch's ``FullyShardedDataParallel`` class or flatshard's).

Usage::

    python benchmarks/torch_fsdp2_tests.py --tests-dir /tmp/torch_fsdp2_tests \\
        --impl torch|flatshard [--files test_fully_shard_init.py ...] [--out results.json]
    python benchmarks/torch_fsdp2_tests.py --compare torch.json flatshard.json

torch's test files (``test/distributed/_composable/fsdp/test_fully_shard_*.py``) are not part of
this repository: fetch them into ``--tests-dir`` yourself. Each file runs in its own pytest
process, one file at a time, with a per-test timeout (pytest-timeout when installed) and a
per-file one (coreutils ``timeout``).

How ``--impl flatshard`` swaps the implementation
-------------------------------------------------
The runner writes a ``sitecustomize.py`` into a temporary directory and puts that directory
first on ``PYTHONPATH``. Python imports ``sitecustomize`` at start-up in *every* interpreter
that inherits the environment: the pytest process (where ``FSDPTestMultiThread`` runs its ranks
as threads) and every rank process that ``FSDPTest`` / ``FSDPTestContinuous`` spawn. That
``sitecustomize`` loads this file as the module ``torch_fsdp2_tests`` and calls
:func:`_bootstrap`, which, before any test module is imported, rebinds ``fully_shard`` to
flatshard's in ``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard``,
``torch.distributed.fsdp._fully_shard._fully_shard`` and ``torch.distributed._composable.fsdp``.
Test modules that run ``from torch.distributed.fsdp import fully_shard`` therefore bind
flatshard's. ``FSDPModule`` is left as torch's class: flatshard's modules are instances of a
subclass of it, so ``isinstance`` checks hold and its methods are flatshard's.

flatshard's ``fully_shard`` is wrapped in a thin recorder (same ``__name__``, signature and
docstring) that appends ``<pid> <impl>`` to ``$FSDP2_TESTS_PROBE`` the first time a process
calls it; the summary reports how many processes called flatshard's, which shows that the
swap reached the spawned rank processes too.

The same file is the pytest plugin (``-p torch_fsdp2_tests``) that writes every test's outcome
(passed / failed / skipped / error) and, for failures, the exception line to a JSON file.

``--api fsdp1``: torch's FSDP1 test files (``test/distributed/fsdp/test_fsdp_*.py``) construct
``torch.distributed.fsdp.FullyShardedDataParallel``; for ``--impl flatshard`` the bootstrap calls
``flatshard.install_as_torch_fsdp()`` (the opt-in frameworks use), so that the class, its static methods
and torch's state-dict helpers are flatshard's in every test process. Those files gate each test on
GPUs (``@skip_if_lt_x_gpu(n)``, a ``world_size`` of ``min(device_count(), 2)``): with
``--cpu-multiprocess`` the gates pass (``_lift_gpu_gates``) and the ranks are gloo processes. Most FSDP2 files gate
their tests the same way; ``--lift-gpu-gates`` (with ``--cpu-multiprocess``) lifts them there too.

CPU-only machines
-----------------
torch 2.13's ``FSDPTest._run`` and ``FSDPTestContinuous._init_pg`` exit with "skip" whenever
``torch.accelerator.device_count() < world_size``, i.e. always without a GPU, even for tests
that newer torch files mark ``@skip_if_lt_x_gpu(n, allow_cpu=True)`` (which newer torch runs
on gloo). ``--cpu-multiprocess`` lifts only that check (for those two functions; every other
caller sees the real device count), so that such tests run with their ranks as gloo processes.
It is off by default: without it the counts are what torch 2.13 itself gives on the machine.
Without it, those tests are marked skipped at collection, with torch's own skip message,
instead of spawning up to 8 rank processes each only to exit with that skip (about 30 s of
CPU per test on 2 cores); ``--no-fast-skip`` restores the spawning.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_ENV_IMPL = "FSDP2_TESTS_IMPL"  # "torch" or "flatshard", set by the runner for the test processes
_ENV_RESULTS = "FSDP2_TESTS_RESULTS"  # JSON file the plugin writes the outcomes to
_ENV_PROBE = "FSDP2_TESTS_PROBE"  # file the flatshard recorder appends "<pid> <impl>" to
_ENV_CPU_MP = "FSDP2_TESTS_CPU_MULTIPROCESS"  # "1": lift the accelerator-count check (see above)
_ENV_FAST_SKIP = "FSDP2_TESTS_FAST_SKIP"  # "0": spawn FSDPTest ranks even where they would only skip
_ENV_API = "FSDP2_TESTS_API"  # "fsdp2" (fully_shard, the default) or "fsdp1" (the FullyShardedDataParallel class)
_ENV_TESTS_DIR = "FSDP2_TESTS_DIR"  # the test files' directory (fsdp1 on CPUs: see _lift_gpu_gates)
_ENV_LIFT = "FSDP2_TESTS_LIFT_GPU_GATES"  # "1": the FSDP2 files' GPU gates lifted too (--lift-gpu-gates)

_DEFAULT_TIMEOUT_S = 300  # per test
_DEFAULT_FILE_TIMEOUT_S = 1200  # per file


# ----------------------------------------------------------------------------------------------
# In the test processes: swapping fully_shard (called from the generated sitecustomize.py)
# ----------------------------------------------------------------------------------------------

def _bootstrap() -> None:
    """Runs at interpreter start-up in every test process (via sitecustomize)."""
    impl = os.environ.get(_ENV_IMPL)
    fsdp1 = os.environ.get(_ENV_API) == "fsdp1"
    if impl == "flatshard":
        _install_flatshard_class() if fsdp1 else _install_flatshard()
    if os.environ.get(_ENV_CPU_MP) == "1":
        if fsdp1 or os.environ.get(_ENV_LIFT) == "1":  # (first: _lift_accelerator_check's wrapper must see its
            _lift_gpu_gates(fsdp1)  # callers as frame 1)
        _lift_accelerator_check()


def _install_flatshard_class() -> None:
    """``--api fsdp1``: torch's FSDP1 class (and its static methods, state-dict helpers) is flatshard's, through
    flatshard's own opt-in (``install_as_torch_fsdp``), as the frameworks get it. A probe line per process, as above."""
    import flatshard

    flatshard.install_as_torch_fsdp()
    probe_path = os.environ.get(_ENV_PROBE)
    if probe_path:
        with open(probe_path, "a") as f:
            f.write(f"{os.getpid()} flatshard.install_as_torch_fsdp\n")


def _lift_gpu_gates(fsdp1: bool) -> None:
    """torch's FSDP1 test files, and most FSDP2 ones, gate every test on GPUs: ``@skip_if_lt_x_gpu(n)`` (no
    ``allow_cpu``), and classes whose ``world_size`` is ``min(<a device count>, 2)``. On a CPU machine with
    --cpu-multiprocess (and, for the FSDP2 files, --lift-gpu-gates): the decorator (and ``requires_nccl_version``)
    passes the test through, the device counts answer 2 to code in the test files (nowhere else; FSDP1's files ask
    ``torch.accelerator``, FSDP2's ``torch.cuda`` and ``torch.cpu``), ``common_fsdp.FSDP_DEVICES`` (newer than torch
    2.13; test_fsdp_apply.py imports it) is ``("cpu",)``, and DDP, which the FSDP2 files' reference models use with
    ``device_ids=[rank]``, takes a CPU module without them. Files that move their models with ``.cuda()`` still need
    a CPU copy (RESULTS.md says which were run so)."""
    import torch
    from torch.testing._internal import common_distributed, common_fsdp

    def skip_if_lt_x_gpu(n, *args, **kwargs):
        return lambda fn: fn

    def requires_nccl_version(*args, **kwargs):
        return lambda fn: fn

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    common_distributed.requires_nccl_version = requires_nccl_version
    if not hasattr(common_fsdp, "FSDP_DEVICES"):
        common_fsdp.FSDP_DEVICES = ("cpu",)
    tests_dir = os.environ.get(_ENV_TESTS_DIR, "")

    def from_the_tests(real: Callable) -> Callable:
        def device_count(*args, **kwargs):
            frame = sys._getframe(1)
            for _ in range(3):  # (the caller, through _lift_accelerator_check's wrapper around this one)
                if frame is None:
                    break
                if tests_dir and frame.f_code.co_filename.startswith(tests_dir):
                    return 2
                frame = frame.f_back
            return real(*args, **kwargs)

        return device_count

    if fsdp1:
        torch.accelerator.device_count = from_the_tests(torch.accelerator.device_count)
        return
    torch.cuda.device_count = from_the_tests(torch.cuda.device_count)
    torch.cpu.device_count = from_the_tests(torch.cpu.device_count)
    from torch.nn.parallel import DistributedDataParallel

    real_init = DistributedDataParallel.__init__

    def init(self, module, *args, **kwargs):
        if {p.device.type for p in module.parameters()} == {"cpu"}:
            args = (None, None, *args[2:]) if args else args  # (device_ids, output_device: its first two)
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        real_init(self, module, *args, **kwargs)

    DistributedDataParallel.__init__ = init


def _install_flatshard() -> None:
    """Rebinds ``fully_shard`` to flatshard's wherever torch exports it."""
    import functools

    import flatshard  # imported after torch's modules: flatshard subclasses torch's FSDPModule
    import torch.distributed._composable.fsdp as composable_fsdp
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp._fully_shard as fully_shard_pkg
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_mod

    impl_fn = flatshard.fully_shard
    probe_path = os.environ.get(_ENV_PROBE)
    recorded = False

    @functools.wraps(impl_fn)
    def fully_shard(*args, **kwargs):
        nonlocal recorded
        if not recorded and probe_path:
            recorded = True
            with open(probe_path, "a") as f:
                f.write(f"{os.getpid()} {impl_fn.__module__}\n")
        return impl_fn(*args, **kwargs)

    for module in (fsdp, fully_shard_pkg, fully_shard_mod, composable_fsdp):
        module.fully_shard = fully_shard


def _lift_accelerator_check() -> None:
    """Makes ``torch.accelerator.device_count()`` answer "enough" to FSDPTest's rank set-up only."""
    import torch
    from torch.testing._internal import common_fsdp

    guarded = {common_fsdp.FSDPTest._run.__func__.__code__}
    continuous = getattr(common_fsdp, "FSDPTestContinuous", None)
    if continuous is not None:
        guarded.add(continuous._init_pg.__func__.__code__)
    real_device_count = torch.accelerator.device_count

    def device_count(*args, **kwargs):
        if sys._getframe(1).f_code in guarded:
            return 1 << 16
        return real_device_count(*args, **kwargs)

    torch.accelerator.device_count = device_count
    # torch's FSDP1 refuses a CPU module without device_id when no accelerator is present ("FSDP needs a non-CPU
    # accelerator device"), which these files never pass: torch's own device selection takes the CPU instead (the
    # oracle only; flatshard's class takes a CPU module as it is).
    from torch.distributed.fsdp import _init_utils, fully_sharded_data_parallel

    real_init_device_handle = _init_utils._init_device_handle

    def init_device_handle(state, module, ignored_params, device_id):
        if device_id is None and torch.accelerator.current_accelerator() is None:
            device_id = torch.device("cpu")
        return real_init_device_handle(state, module, ignored_params, device_id)

    _init_utils._init_device_handle = fully_sharded_data_parallel._init_device_handle = init_device_handle


# ----------------------------------------------------------------------------------------------
# In the pytest process: the plugin that records outcomes (loaded with -p torch_fsdp2_tests)
# ----------------------------------------------------------------------------------------------

_OUTCOMES: dict[str, dict] = {}

# An exception line in a (possibly nested, child-process) traceback: "ValueError: ...".
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed|Timeout))(?::\s?(.*))?$")
# The wrappers torch's distributed test cases put around a rank's own exception.
_WRAPPER = re.compile(r"(Process|Thread) \d+ (exited|terminated|timed out)")


def _summarize_error(text: str) -> str:
    """The most telling exception line of a failure report.

    pytest marks the exception lines of a report with a leading "E"; source lines it quotes
    are not marked, so only marked lines count when there are any. A rank's failure reaches
    pytest wrapped ("RuntimeError: Process 0 exited with error code 10 and exception:" followed
    by the rank's traceback, or "Thread 1 exited with exception:"); the rank's own exception is
    the telling one, so wrapper lines are skipped, and the last remaining line (the exception
    finally raised) is taken.
    """
    lines = text.splitlines()
    marked = [line[1:].strip() for line in lines if line.startswith("E ")]
    candidates = []
    for line in marked or [line.strip() for line in lines]:
        match = _EXC_LINE.match(line)
        if match and not _WRAPPER.search(line):
            candidates.append(f"{match.group(1)}: {match.group(2) or ''}".strip())
    if not candidates:
        return (marked[-1] if marked else (lines[-1] if lines else ""))[:400]
    return candidates[-1][:400]


def _record(nodeid: str, outcome: str, report) -> None:
    entry = _OUTCOMES.setdefault(nodeid, {"outcome": outcome, "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + getattr(report, "duration", 0.0), 3)
    # A setup/teardown error outranks a pass; a failure outranks both.
    rank = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}
    if rank[outcome] >= rank[entry["outcome"]]:
        entry["outcome"] = outcome
    if outcome in ("failed", "error"):
        text = getattr(report, "longreprtext", "") or str(report.longrepr)
        entry["error"] = _summarize_error(text)
        entry["details"] = text[-4000:]
    elif outcome == "skipped" and isinstance(report.longrepr, tuple):
        entry["reason"] = str(report.longrepr[2])[:300]


def pytest_collection_modifyitems(session, config, items) -> None:  # pytest hook
    """Skips up front what torch 2.13 would skip after spawning its rank processes.

    Without accelerators (and without --cpu-multiprocess), ``FSDPTest._run`` /
    ``FSDPTestContinuous._init_pg`` exit every rank with torch's "multi-gpu-N" skip before the
    test body runs, whatever the test. Spawning up to 8 rank processes to learn that costs
    about 30 s of CPU per test; marking the test skipped here, with torch's own message, gives
    the same outcome at no cost. ``FSDP2_TESTS_FAST_SKIP=0`` turns this off.
    """
    if os.environ.get(_ENV_CPU_MP) == "1" or os.environ.get(_ENV_FAST_SKIP) == "0":
        return
    import pytest
    import torch
    from torch.testing._internal import common_fsdp
    from torch.testing._internal.common_distributed import TEST_SKIPS

    if torch.accelerator.device_count() > 0:
        return
    bases = tuple(c for c in (common_fsdp.FSDPTest, getattr(common_fsdp, "FSDPTestContinuous", None)) if c)
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(cls, bases):
            continue
        world_size = cls.world_size if isinstance(cls.__dict__.get("world_size"), int) else None
        if world_size is None:  # a property: ask an instance (constructing a TestCase runs nothing)
            try:
                world_size = cls(item.name).world_size
            except Exception:
                continue
        if isinstance(world_size, int) and world_size > 0:
            skip = TEST_SKIPS.get(f"multi-gpu-{world_size}")
            reason = skip.message if skip else f"Need at least {world_size} CUDA devices"
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report) -> None:  # pytest hook
    if report.when == "call":
        outcome = report.outcome if report.outcome in ("passed", "failed", "skipped") else "error"
        _record(report.nodeid, outcome, report)
    elif report.failed:  # setup or teardown raised
        _record(report.nodeid, "error", report)
    elif report.skipped:  # skipped in setup (decorators, skipIf)
        _record(report.nodeid, "skipped", report)


def pytest_collectreport(report) -> None:  # pytest hook
    if report.failed:
        text = getattr(report, "longreprtext", "") or str(report.longrepr)
        _OUTCOMES[f"{report.nodeid or '<collection>'}::<collection>"] = {
            "outcome": "error", "error": _summarize_error(text), "details": text[-4000:]}


def pytest_sessionfinish(session, exitstatus) -> None:  # pytest hook
    path = os.environ.get(_ENV_RESULTS)
    if path:
        with open(path, "w") as f:
            json.dump(_OUTCOMES, f, indent=1, sort_keys=True)


# ----------------------------------------------------------------------------------------------
# The runner (CLI)
# ----------------------------------------------------------------------------------------------

_SITECUSTOMIZE = """\
# Generated by benchmarks/torch_fsdp2_tests.py: loads it and swaps fully_shard if asked to.
import importlib.util as _util
import sys as _sys

_spec = _util.spec_from_file_location("torch_fsdp2_tests", {runner!r})
_module = _util.module_from_spec(_spec)
_sys.modules["torch_fsdp2_tests"] = _module
_spec.loader.exec_module(_module)
_module._bootstrap()
"""


def _have_pytest_timeout() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


def run_file(test_file: Path, impl: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Runs one test file in its own pytest process; returns its outcomes and timings."""
    results_path = workdir / f"{test_file.stem}.{impl}.json"
    probe_path = workdir / f"{test_file.stem}.{impl}.probe"
    for p in (results_path, probe_path):
        p.unlink(missing_ok=True)

    env = dict(os.environ)
    paths = [str(workdir / "site")]
    if impl == "flatshard" and args.flatshard_path:
        paths.append(args.flatshard_path)
    paths += args.extra_path
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[_ENV_IMPL] = impl
    env[_ENV_RESULTS] = str(results_path)
    env[_ENV_PROBE] = str(probe_path)
    env[_ENV_CPU_MP] = "1" if args.cpu_multiprocess else "0"
    env[_ENV_LIFT] = "1" if args.lift_gpu_gates else "0"
    env[_ENV_FAST_SKIP] = "0" if args.no_fast_skip else "1"
    env[_ENV_API] = args.api
    env[_ENV_TESTS_DIR] = str(test_file.parent)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the machine's cores

    cmd = [sys.executable, "-m", "pytest", str(test_file), "-p", "torch_fsdp2_tests",
           "-p", "no:cacheprovider", "-q", "-rN", "--tb=long",
           # (this module is imported by sitecustomize before pytest could rewrite it: harmless)
           "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if _have_pytest_timeout():
        cmd += [f"--timeout={args.timeout}"]
    if args.k:
        cmd += ["-k", args.k]
    if shutil.which("timeout"):
        cmd = ["timeout", "-k", "30", str(args.file_timeout)] + cmd

    start = time.monotonic()
    log_path = workdir / f"{test_file.stem}.{impl}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=test_file.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall_s = time.monotonic() - start

    tests = json.loads(results_path.read_text()) if results_path.exists() else {}
    note = None
    if proc.returncode in (124, 137) and not results_path.exists():
        note = f"file timed out after {args.file_timeout} s"
    elif not results_path.exists():
        note = f"pytest exited with {proc.returncode} and wrote no results (see {log_path})"
    probe_pids = probe_path.read_text().split("\n") if probe_path.exists() else []
    return {
        "file": test_file.name,
        "impl": impl,
        "returncode": proc.returncode,
        "wall_s": round(wall_s, 1),
        "log": str(log_path),
        "note": note,
        "flatshard_processes": len([line for line in probe_pids if line.strip()]),
        "tests": tests,
    }


def _counts(tests: dict) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for entry in tests.values():
        counts[entry["outcome"]] += 1
    return counts


def print_summary(files: list[dict]) -> None:
    header = f"{'file':<42} {'impl':<9} {'pass':>5} {'fail':>5} {'skip':>5} {'err':>4} {'wall s':>7}  ranks"
    print(header)
    print("-" * len(header))
    for entry in files:
        c = _counts(entry["tests"])
        print(f"{entry['file']:<42} {entry['impl']:<9} {c['passed']:>5} {c['failed']:>5} {c['skipped']:>5} "
              f"{c['error']:>4} {entry['wall_s']:>7}  {entry['flatshard_processes'] or ''}"
              + (f"  [{entry['note']}]" if entry.get("note") else ""))


def compare(torch_json: Path, flatshard_json: Path) -> None:
    """Prints, per file, the counts of both runs and each test that passes with torch only."""
    ref = {f["file"]: f for f in json.loads(torch_json.read_text())["files"]}
    new = {f["file"]: f for f in json.loads(flatshard_json.read_text())["files"]}
    header = f"{'file':<42} {'torch p/f/s/e':>16} {'flatshard p/f/s/e':>18}"
    print(header)
    print("-" * len(header))
    for name in sorted(set(ref) | set(new)):
        cells = []
        for side in (ref, new):
            c = _counts(side[name]["tests"]) if name in side else None
            cells.append("/".join(str(c[k]) for k in ("passed", "failed", "skipped", "error")) if c else "-")
        print(f"{name:<42} {cells[0]:>16} {cells[1]:>18}")
    print("\nPass with torch, not with flatshard:")
    for name in sorted(set(ref) & set(new)):
        for nodeid, entry in sorted(ref[name]["tests"].items()):
            other = new[name]["tests"].get(nodeid)
            if entry["outcome"] == "passed" and (other is None or other["outcome"] != "passed"):
                outcome = other["outcome"] if other else "missing"
                print(f"  {nodeid}  [{outcome}]  {other.get('error', '') if other else ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests-dir", type=Path, help="directory holding torch's test_fully_shard_*.py files")
    parser.add_argument("--impl", choices=("torch", "flatshard"), default="torch")
    parser.add_argument("--api", choices=("fsdp2", "fsdp1"), default="fsdp2",
                        help="fsdp2: swap fully_shard (test_fully_shard_*.py); fsdp1: swap the FullyShardedDataParallel "
                             "class through flatshard's opt-in (torch's test/distributed/fsdp/test_fsdp_*.py)")
    parser.add_argument("--files", nargs="*", help="file names in --tests-dir (default: every test_fully_shard_*.py)")
    parser.add_argument("--out", type=Path, help="JSON file for the per-test outcomes")
    parser.add_argument("-k", help="pytest -k expression, applied to every file")
    parser.add_argument("--timeout", type=int, default=_DEFAULT_TIMEOUT_S, help="per-test timeout (s)")
    parser.add_argument("--file-timeout", type=int, default=_DEFAULT_FILE_TIMEOUT_S, help="per-file timeout (s)")
    parser.add_argument("--flatshard-path", default=os.environ.get("FLATSHARD_PATH"),
                        help="directory to put on PYTHONPATH for `import flatshard` (default: $FLATSHARD_PATH; "
                             "none needed when flatshard is installed)")
    parser.add_argument("--extra-path", action="append", default=[],
                        help="further PYTHONPATH entries for the test processes (e.g. where expecttest is)")
    parser.add_argument("--cpu-multiprocess", action="store_true",
                        help="run FSDPTest/FSDPTestContinuous ranks as gloo processes on a machine without "
                             "accelerators (lifts torch 2.13's device-count skip; see the module docstring)")
    parser.add_argument("--lift-gpu-gates", action="store_true",
                        help="with --cpu-multiprocess: run the FSDP2 files' GPU-gated tests on CPU ranks too (see "
                             "_lift_gpu_gates; the FSDP1 files' gates are lifted by --cpu-multiprocess alone)")
    parser.add_argument("--no-fast-skip", action="store_true",
                        help="let FSDPTest spawn its rank processes even where torch 2.13 skips them on a "
                             "machine without accelerators (same outcome, about 30 s per test)")
    parser.add_argument("--workdir", type=Path, help="where logs and per-file JSON go (default: a temp dir)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("TORCH_JSON", "FLATSHARD_JSON"),
                        help="compare two --out files instead of running")
    args = parser.parse_args(argv)

    if args.compare:
        compare(*args.compare)
        return 0
    if args.tests_dir is None:
        parser.error("--tests-dir is required")

    tests_dir = args.tests_dir.resolve()
    names = args.files or sorted(p.name for p in tests_dir.glob(
        "test_fsdp_*.py" if args.api == "fsdp1" else "test_fully_shard_*.py"))
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="torch_fsdp2_tests-"))).resolve()
    (workdir / "site").mkdir(parents=True, exist_ok=True)
    (workdir / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(runner=str(Path(__file__).resolve())))

    files = []
    for name in names:
        entry = run_file(tests_dir / name, args.impl, args, workdir)
        files.append(entry)
        c = _counts(entry["tests"])
        print(f"[{args.impl}] {name}: {c} in {entry['wall_s']} s" + (f" ({entry['note']})" if entry["note"] else ""),
              flush=True)
    print()
    print_summary(files)
    if args.out:
        args.out.write_text(json.dumps({"impl": args.impl, "cpu_multiprocess": args.cpu_multiprocess,
                                        "lift_gpu_gates": args.lift_gpu_gates,
                                        "k": args.k, "files": files}, indent=1))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
