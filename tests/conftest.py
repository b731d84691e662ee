"""pytest setup: make the helper modules in tests/ (``_cases``, ``models``) importable,
and skip the GPU tests where there is no GPU. The ranks come from flatshard.testing's plugin.

The helpers are imported by name both here and in the rank processes (which get this
``sys.path`` from the parent), so the tests directory goes on ``sys.path`` explicitly
instead of relying on pytest's rootdir handling.

A test that needs CUDA is marked ``gpu`` (``pytestmark = pytest.mark.gpu`` in a GPU-only
file, ``@pytest.mark.gpu`` on one test) and carries no skip condition of its own for
it: without CUDA, ``pytest_collection_modifyitems`` below skips every such test, with
the reason "needs a CUDA GPU". Conditions other than "no CUDA" stay on the test. A GPU
machine runs them with ``-m gpu`` (scripts/gpu_session.sh).
"""

import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one (see tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
