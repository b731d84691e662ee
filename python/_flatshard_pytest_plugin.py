"""flatshard.testing's pytest plugin: ``@pytest.mark.world_size(2, 4)`` runs a test function on that many ranks.

PYTEST_DONT_REWRITE. A top-level module of its own, importing nothing of flatshard (nor torch) until a marked test
runs: pytest loads it in every session of an environment where flatshard is installed, and neither the start of
those sessions nor their life may depend on flatshard's extension loading.

[Note: The world_size marker]
A test function marked ``world_size(*sizes, backend=None, timeout=None)`` asks for the fixtures
``rank`` and ``world_size``; the plugin parametrizes ``world_size`` over the sizes (ids ``W2``,
``W4``) and, instead of calling the function in the pytest process, runs it on that many ranks
with ``run_distributed`` (each rank a process with a process group: see [Note: Backends and
devices] in flatshard/testing/_harness.py), ``rank`` set in each. Its other fixtures are made in the pytest process
and handed to every rank (they must pickle: ``tmp_path`` does). The first failing rank's
traceback (assertions rewritten, with their values) and log are the test's failure; a rank that
hangs fails the test at the deadline with every unfinished rank's stacks; nothing is left running.
The function must be defined at module level (ranks import it by name). Its return value is
ignored, as pytest ignores a test's; ``run_distributed`` called inside a test returns each rank's.

Options (command line, or ``[tool.pytest.ini_options]``): ``--rank-backend`` / ``rank_backend``
(``auto``, ``gloo``, ``nccl``: what ``run_distributed`` and the marker use where a test names none), ``--rank-timeout`` / ``rank_timeout`` (seconds a ranked test may
run, 120 by default; the marker's ``timeout=`` wins), ``rank_preload`` (modules the fork server
imports first, see [Note: Fast start]).
"""

from __future__ import annotations

from typing import Any

import pytest

# The session's settings, read by flatshard.testing._harness when it first runs (this module imports nothing of
# flatshard): "backend" (None: auto) and "preload" (module names).
SETTINGS: dict[str, Any] = {"backend": None, "preload": []}

_DEFAULT_TIMEOUT_S = 120.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flatshard.testing", "multi-rank tests (flatshard.testing)")
    group.addoption("--rank-backend", choices=("auto", "gloo", "nccl"), default=None,
                    help="process group backend of the ranks (world_size-marked tests, run_distributed) where a test "
                         "names none (default: auto, NCCL where every rank has a GPU, else gloo)")
    group.addoption("--rank-timeout", type=float, default=None,
                    help=f"seconds a world_size-marked test may run before its ranks' stacks are dumped and they are "
                         f"killed (default {_DEFAULT_TIMEOUT_S:.0f})")
    parser.addini("rank_backend", "default process group backend of the ranks (auto, gloo, nccl)", default="auto")
    parser.addini("rank_timeout", "default deadline (seconds) of world_size-marked tests", default="")
    parser.addini("rank_preload", "modules the ranks' fork server imports before forking", type="linelist",
                  default=[])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world_size(*sizes, backend=None, timeout=None): run the test on that many ranks, one process "
                   "each, parametrized over the sizes (fixtures rank and world_size; see flatshard.testing)")
    SETTINGS["preload"] = list(config.getini("rank_preload"))
    chosen = config.getoption("--rank-backend") or config.getini("rank_backend")
    SETTINGS["backend"] = None if chosen in (None, "", "auto") else chosen


@pytest.fixture
def rank() -> int:
    """This rank's number inside a ``world_size``-marked test (0 in the pytest process, which runs none of it)."""
    return 0


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return
    # (A misuse fails the collection of its file, as pytest's own marker errors do; the other files run.)
    sizes = [int(s) for s in marker.args]
    if not sizes or any(s < 1 for s in sizes):
        pytest.fail(f"{metafunc.definition.nodeid}: @pytest.mark.world_size needs one or more sizes >= 1, got "
                    f"{marker.args}", pytrace=False)
    if "world_size" not in metafunc.fixturenames or "rank" not in metafunc.fixturenames:
        pytest.fail(f"{metafunc.definition.nodeid}: a world_size-marked test takes the arguments rank and world_size "
                    f"(def {metafunc.function.__name__}(rank, world_size, ...))", pytrace=False)
    metafunc.parametrize("world_size", sizes, ids=[f"W{s}" for s in sizes])


def _backend(marker: pytest.Mark) -> str | None:
    """The marker's backend, else the session's (see pytest_configure)."""
    chosen = marker.kwargs.get("backend")
    return None if chosen in (None, "", "auto") else chosen


def _timeout(item: pytest.Item, marker: pytest.Mark) -> float:
    given = marker.kwargs.get("timeout") or item.config.getoption("--rank-timeout") or item.config.getini(
        "rank_timeout")
    return float(given) if given else _DEFAULT_TIMEOUT_S


def _call_test(rank: int, world_size: int, test: Any, kwargs: dict[str, Any]) -> None:
    """In each rank: the test function with its fixtures, ``rank`` and ``world_size`` among them."""
    test(**kwargs, rank=rank, world_size=world_size)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    from flatshard.testing._harness import _run

    __tracebackhide__ = True  # (the report is the ranks' failure, not this hook's lines)
    test = pyfuncitem.obj
    if "." in getattr(test, "__qualname__", ""):
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: a world_size-marked test must be a module-level function (its "
                                f"ranks import it by name), not a method or a nested function")
    fixtures = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    world_size = fixtures.pop("world_size")
    fixtures.pop("rank")
    _run(_call_test, world_size, (test, fixtures), {}, backend=_backend(marker),
         timeout=_timeout(pyfuncitem, marker), pg_timeout=None, rewrite_from=test)
    return True
