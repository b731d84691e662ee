"""``flatshard.testing``: multi-rank tests under plain pytest, for any FSDP (torch's or flatshard's).

A pytest plugin (the top-level module ``_flatshard_pytest_plugin``, registered on install): a test function
marked ``@pytest.mark.world_size(2, 4)`` runs on that many ranks, each a process with a process group (see
[Note: The world_size marker] there); inside any test, ``run_distributed(fn, world_size, ...)``
runs a module-level function on the ranks and returns what each returned (see [Note: Never hang]
and [Note: Backends and devices] in _harness.py); ``compare_with_single_process`` checks a sharded
run against one process on the same global batch (see [Note: Comparing with a single process] in
_compare.py). The plugin imports nothing of flatshard until a marked test runs.
"""

from flatshard.testing._compare import Comparison, compare_with_single_process
from flatshard.testing._harness import (
    DistributedTestFailure,
    DistributedTestTimeout,
    abandon_group,
    check_same_outcome,
    preload,
    run_distributed,
    set_default_backend,
)

__all__ = [
    "Comparison",
    "DistributedTestFailure",
    "DistributedTestTimeout",
    "abandon_group",
    "check_same_outcome",
    "compare_with_single_process",
    "preload",
    "run_distributed",
    "set_default_backend",
]
