"""What ``import flatshard`` loads: a training process pays for no more than it uses (issue 30, item 6).

A fresh interpreter (the pytest process has imported everything by now).
"""

from __future__ import annotations

import subprocess
import sys


def test_import_flatshard_leaves_the_planner_until_it_is_used():
    done = subprocess.run([sys.executable, "-c", "import sys, flatshard\n"
                           "print(sorted(m for m in sys.modules if m.startswith('flatshard.plan')))\n"
                           "flatshard.plan.measure_activations\n"
                           "print(callable(flatshard.plan), 'flatshard.plan._costs' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "True True"], done.stdout
