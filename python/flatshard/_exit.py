"""The interpreter's exit with collectives in flight: see [Note: Exit]."""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flatshard._state import RootState

# [Note: Exit]
# gloo keeps each collective's work object on its own worker thread until the
# collective has run, and destroys it there; the object holds the thread-local
# state of the moment it was issued, which can own Python objects. If a
# collective is still in flight when the interpreter shuts down (a backward
# raised on every rank and the script let the exception end it: the
# prefetched all-gather and the reductions of that backward are still
# running), the worker releases that Python object during finalization and
# the process dies by SIGABRT instead of exiting with its traceback and
# status 1. So at exit (atexit runs before finalization) every live root's
# in-flight collectives are waited for, for at most EXIT_DRAIN_SECONDS (a
# collective whose peers will never issue it is abandoned: it will not complete
# during finalization either), then briefly more, for the workers to drop the
# objects they finished with. Nothing else changes: no collective is issued.
#
# That still left 1-2 of 60 such exits (tests/test_exit.py) to "terminate called without
# an active exception" (SIGABRT) later in finalization, from a thread of torch's or gloo's
# destroyed while joinable (which thread was not found). So when an uncaught exception
# ended the script (Python has printed its traceback and set sys.last_value; the status will
# be 1) and collectives were in flight, the exit ends here, with status 1, after flushing
# stdio and logging: the rest of finalization (and the atexit handlers registered before
# flatshard's) is skipped, which is what an abort would have skipped too.

EXIT_DRAIN_SECONDS = 10.0
_live_roots: weakref.WeakSet[RootState] = weakref.WeakSet()


def register_for_exit(root: RootState) -> None:
    _live_roots.add(root)


def _drain_at_exit() -> None:
    waited = False
    deadline = time.monotonic() + EXIT_DRAIN_SECONDS  # for all roots together
    for root in list(_live_roots):
        scheduler = root.scheduler
        try:
            _, had_any = scheduler.drain(max(0.0, deadline - time.monotonic()))
            waited = waited or had_any
        except Exception:  # noqa: BLE001 (exiting: nothing to report it to)
            pass
    if waited:
        # The workers drop a finished collective's object after its waiter wakes: give them the time
        # (0.05 s left 1–3 of 60 exits to a signal on a loaded 2-core machine; costs only exits that drained).
        time.sleep(0.5)
        if getattr(sys, "last_value", None) is not None:  # an uncaught exception: its status, 1, now
            _exit_now(1)


def _exit_now(status: int) -> None:
    import logging

    for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
        try:
            flush()
        except Exception:  # noqa: BLE001 (exiting: nothing to report it to)
            pass
    os._exit(status)


atexit.register(_drain_at_exit)
