"""pytest setup: make the helper modules in tests/ (``_dist``, ``models``) importable.

They are imported by name both here and in the rank processes (which get this
``sys.path`` from the parent), so the tests directory goes on ``sys.path`` explicitly
instead of relying on pytest's rootdir handling.
"""

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
